"""A server started with a reasoning parser (`--reasoning-parser`): a thinking model's reasoning returned beside
its answer, whole and streamed, on the chat route and the Responses API, with the model's own tool calls after
it; reasoning sent back reaches the chat template; a constraint holds from after the thought. The tiny model
does not think, so each reply is made to by a regex given as the whole reply (the requests' constraint hidden
from the server, which would let the thought go free and hold the regex after it)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from kestrel.serve.protocol import ChatCompletionRequest
from tests.serve.conftest import MODEL, RunningServer, force_responses_reply
from tests.serve.test_tools import TOOLS

REASONING = "The user wants Oslo's weather: call the tool."
REPLY = (
    f"<think>{REASONING}</think>\n"
    "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)
CHAT = [{"role": "user", "content": "Weather in Oslo?"}]
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server():
    s = RunningServer(reasoning_parser="qwen3", tool_call_parser="kimi_k2")
    yield s
    s.close()


@pytest.fixture
def client(server, monkeypatch):
    """Requests whose regex the parsers do not see as a constraint (the Responses API's given one here)."""
    monkeypatch.setattr(ChatCompletionRequest, "constraint_field", property(lambda self: None))
    force_responses_reply(monkeypatch, REPLY)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


FORCED = {"structured_outputs": {"regex": re.escape(REPLY)}}


def test_chat_reasoning_answer_and_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=400, extra_body=FORCED
    )
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == REASONING
    assert message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert r.choices[0].finish_reason == "tool_calls"


def test_chat_stream_adds_up_to_the_same(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=400, stream=True, extra_body=FORCED
        )
    )
    reasoning = content = arguments = ""
    seen = []  # the kinds of delta, in order
    for ch in chunks:
        delta = ch.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning += extra["reasoning_content"]
            seen.append("reasoning")
        if delta.content:
            content += delta.content
            seen.append("content")
        for t in delta.tool_calls or []:
            arguments += t.function.arguments or ""
            seen.append("call")
    assert (reasoning, content, json.loads(arguments)) == (REASONING, "Let me check.", {"city": "Oslo"})
    assert seen.index("content") > max(k for k, kind in enumerate(seen) if kind == "reasoning")
    assert seen.count("reasoning") > 1  # streamed as it is written
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_items_and_reasoning_tokens(client):
    kw = {"model": MODEL, "input": "Weather in Oslo?", "tools": FLAT, "max_output_tokens": 400}
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == REASONING and r.output[0].id.startswith("rs_")
    assert r.output[1].content[0].text == "Let me check."
    # the byte tokenizer: a token a character, up to and with </think>
    assert r.usage.output_tokens_details.reasoning_tokens == len(f"<think>{REASONING}</think>")
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "function_call", "message"]  # the message closes last
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert (
        final.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens_details.reasoning_tokens
    )
    # the client sends the output back as the next turn's input: taken, the reasoning item included
    turns = [{"role": "user", "content": "Weather in Oslo?"}, *[o.model_dump(mode="json") for o in r.output]]
    turns.append({"type": "function_call_output", "call_id": r.output[2].call_id, "output": "sunny"})
    again = client.responses.create(**{**kw, "input": turns})
    assert again.status == "completed"


def test_reasoning_sent_back_reaches_the_template(make_server):
    template = (
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m.reasoning_content %}[thought:{{ m.reasoning_content }}]{% endif %}{{ m['content'] or '' }}"
        "{% endfor %}<assistant>"
    )
    s = make_server(chat_template=template, reasoning_parser="qwen3")
    for key in ("reasoning_content", "reasoning"):
        messages = [*CHAT, {"role": "assistant", "content": "Sunny.", key: "look it up"}, *CHAT]
        tok = httpx.post(f"{s.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()
        assert "<assistant>[thought:look it up]Sunny." in s.engine.tokenizer.decode(tok["tokens"])
    item = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hm"}],
    }
    turns = [*CHAT, item, {"role": "assistant", "content": "Sunny."}, *CHAT]
    body = {"model": MODEL, "input": turns, "max_output_tokens": 1}
    with_item = httpx.post(f"{s.url}/v1/responses", json=body, timeout=30).json()
    without = httpx.post(f"{s.url}/v1/responses", json={**body, "input": turns[:1] + turns[2:]}, timeout=30)
    added = with_item["usage"]["input_tokens"] - without.json()["usage"]["input_tokens"]
    assert added == len("[thought:hm]")
    bad = {**body, "input": [*CHAT, {"type": "reasoning", "content": [{"type": "oops", "text": "x"}]}]}
    e = httpx.post(f"{s.url}/v1/responses", json=bad, timeout=30)
    assert e.status_code == 400 and e.json()["error"]["param"].startswith("input.1.content.0.type")


def test_a_constraint_holds_after_the_thought(make_server):
    """With a reasoning parser a constraint holds from after the thought (vLLM's way): deepseek_r1's reply starts
    in it ("opened"), qwen3's may open one ("optional", or "opened" where the prompt did); tool calls held to
    their schemas ("required", named) have no thought before them."""
    import asyncio

    from kestrel.serve.protocol import parse

    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    opening = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>"
    for name, template, want in (
        ("deepseek_r1", None, "opened"),
        ("qwen3", None, "optional"),
        ("qwen3", opening, "opened"),
    ):
        s = make_server(reasoning_parser=name, **({"chat_template": template} if template else {}))
        server = s.app.state.server
        for extra, thought in (
            ({"response_format": fmt}, want),
            ({"tools": TOOLS, "tool_choice": "required"}, None),
        ):
            req = parse(ChatCompletionRequest, json.dumps({"messages": CHAT, **extra}).encode())
            parsers = server.parsers(req, req)
            prompt = server.engine.engine.tokenizer.encode(server.tokenizer.apply_chat_template(CHAT))
            server.see_prompt(parsers, prompt)
            params = asyncio.run(server.sampling_params(req, {}, parsers))
            assert params.structured_outputs.thought == thought, (name, extra)
    # the tiny model thinks on past max_tokens: its reply is reasoning, not JSON forced from the first token
    s = make_server(reasoning_parser="deepseek_r1")
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 30, "response_format": fmt, "seed": 1}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json()
    message = r["choices"][0]["message"]
    assert (
        message["reasoning_content"]
        and message["content"] is None
        and r["choices"][0]["finish_reason"] == "length"
    )


def test_chat_template_kwargs(make_server):
    """vLLM's chat_template_kwargs reach the template on the chat route and /tokenize alike (thinking switched
    on and off per request, as Qwen 3's template reads `enable_thinking`); names the server sets, a non-object
    and a prompt's are 400s."""
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}"
    )
    s = make_server(chat_template=template)
    body = {"model": MODEL, "messages": CHAT}

    def tokens(**extra) -> list[int]:
        r = httpx.post(f"{s.url}/tokenize", json={**body, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    on = tokens(chat_template_kwargs={"enable_thinking": True})
    assert s.engine.tokenizer.decode(on).endswith("Oslo?<think>") and len(on) == len(tokens()) + len(
        "<think>"
    )
    chat = {**body, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": True}}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == len(on)
    for bad, param in (
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ):
        e = httpx.post(f"{s.url}/v1/chat/completions", json={**body, **bad}, timeout=30)
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text
    e = httpx.post(f"{s.url}/tokenize", json={"prompt": "x", "chat_template_kwargs": {"a": 1}}, timeout=30)
    assert e.status_code == 400 and e.json()["error"]["param"] == "chat_template_kwargs"


def test_a_template_that_opens_the_thought(make_server, monkeypatch):
    """A template whose generation prompt ends with <think> (thinking on): the reply starts inside the thought,
    which qwen3 reads as such (it has no <think> of its own)."""
    monkeypatch.setattr(ChatCompletionRequest, "constraint_field", property(lambda self: None))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<think>\n{% endif %}"
    s = make_server(chat_template=template, reasoning_parser="qwen3")
    reply = "Easy.</think>\n\n4"
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 100,
        **{"structured_outputs": {"regex": re.escape(reply)}},
    }
    message = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0][
        "message"
    ]
    assert (message["reasoning_content"], message["content"]) == ("Easy.", "4")


def test_responses_reasoning_settings_are_taken(server):
    body = {
        "model": MODEL,
        "input": "hi",
        "max_output_tokens": 2,
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{server.url}/v1/responses", json={**body, "reasoning": {"effort": "max"}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"


def test_what_the_prompt_says_of_the_thought(make_server):
    """The prompt's end: an empty thought closed (thinking off: Qwen 3's template, enable_thinking false) leaves no
    reasoning to read, even for deepseek_r1; an assistant turn continued inside its thought starts the reply
    there; a thought closed earlier in the conversation changes nothing."""
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    for name in ("qwen3", "deepseek_r1"):
        s = make_server(chat_template=template, reasoning_parser=name)
        server = s.app.state.server
        cases = (
            ({"messages": CHAT}, None, False),
            ({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}, name, False),
            ({"messages": [*CHAT, {"role": "assistant", "content": "<think>So far"}],
              "continue_final_message": True}, name, True),
            ({"messages": [*CHAT, {"role": "assistant", "content": "<think>a</think>b"}, *CHAT],
              "chat_template_kwargs": {"enable_thinking": True}}, name, False),
        )  # fmt: skip
        for body, reads, opened in cases:
            req = ChatCompletionRequest.model_validate(body)
            parsers = server.parsers(req, req)
            text = server.tokenizer.apply_chat_template(req.chat_messages(), **req.template_options())
            server.see_prompt(parsers, server.tokenizer.encode(text))
            assert (parsers.reasoning is not None) == (reads is not None), (name, body)
            assert parsers.opened == opened, (name, body)
