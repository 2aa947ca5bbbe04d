"""tool_choice "auto" on a server started with a tool-call parser (`--tool-call-parser`): the model's own calls
read out of its reply, whole and streamed, on the chat route and the Responses API, through the `openai` client.
The tiny model knows no tool-call format, so each reply is made to write one by a regex (structured outputs),
as a model trained for it would."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.serve.conftest import MODEL, RunningServer, force_responses_reply
from tests.serve.test_tools import TOOLS

KIMI = (
    "Checking."
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone":"CET"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
HERMES = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
# (DeepSeek V3.1's markers: not ASCII, so a stream's pieces may cut a marker's character)
DEEPSEEK_V31 = (
    "Checking.<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>get_time"
    '<\uff5ctool\u2581sep\uff5c>{"zone":"CET"}<\uff5ctool\u2581call\u2581end\uff5c>'
    "<\uff5ctool\u2581calls\u2581end\uff5c>"
)
REPLIES = {"kimi_k2": KIMI, "hermes": HERMES, "deepseek_v31": DEEPSEEK_V31}
EXPECTED = {
    "kimi_k2": [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})],
    "hermes": [("get_weather", {"city": "Oslo"})],
    "deepseek_v31": [("get_time", {"zone": "CET"})],
}
CHAT = [{"role": "user", "content": "Weather and time in Oslo?"}]
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module", params=sorted(REPLIES))
def parsed(request):
    s = RunningServer(tool_call_parser=request.param)
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield request.param, client
    s.close()


def _forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}}


def _calls(calls) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def test_chat_reads_the_models_calls(parsed):
    name, client = parsed
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=300, extra_body=_forced(REPLIES[name])
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert _calls(choice.message.tool_calls) == EXPECTED[name]
    if name == "kimi_k2":  # the model's own ids, which Kimi's template writes back beside the results
        assert [c.id for c in choice.message.tool_calls] == [
            "functions.get_weather:0",
            "functions.get_time:1",
        ]


def test_chat_stream_adds_up_to_the_same_message(parsed):
    name, client = parsed
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            tools=TOOLS,
            max_tokens=300,
            stream=True,
            extra_body=_forced(REPLIES[name]),
        )
    )
    content, calls, finish = "", {}, []
    for ch in chunks:
        delta = ch.choices[0].delta
        content += delta.content or ""
        for t in delta.tool_calls or []:
            call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            assert t.id is None or t.id == call["id"]
            call["arguments"] += t.function.arguments or ""
        finish.append(ch.choices[0].finish_reason)
    assert content == "Checking." and "<" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == EXPECTED[name]
    assert all(c["id"] for c in calls.values())
    assert finish[-1] == "tool_calls" and not any(finish[:-1])
    if name == "kimi_k2":  # arguments stream as the model writes them: more than one chunk a call
        assert (
            sum(1 for ch in chunks for t in ch.choices[0].delta.tool_calls or [] if t.function.arguments) > 2
        )


def test_a_reply_without_calls_is_text(parsed):
    name, client = parsed
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=50, extra_body=_forced("Sunny, 12 C.")
    )
    assert r.choices[0].message.content == "Sunny, 12 C." and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_call_cut_by_max_tokens(parsed):
    """The reply's end cuts a call: finish_reason "length"; the call keeps its arguments so far (Kimi's and
    DeepSeek's as written, Hermes' as its JSON is read)."""
    name, client = parsed
    text = REPLIES[name]
    # inside the first call's arguments (the test model's tokens are bytes)
    cut = len(text[: text.index("Oslo" if "Oslo" in text else "CET") + 2].encode())
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=cut, extra_body=_forced(text)
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    if name == "kimi_k2":
        assert choice.message.tool_calls[0].function.arguments == '{"city":"Os'
    elif name == "deepseek_v31":
        assert choice.message.tool_calls[0].function.arguments == '{"zone":"CE'
    else:  # a Hermes block's JSON as far as it came (the city's string cut short left out)
        assert choice.message.content == "Checking."
        assert choice.message.tool_calls[0].function.arguments == "{}"


def test_responses_items(parsed, monkeypatch):
    """The Responses API takes no regex: its requests' sampling params are given one here, as the chat route's
    structured_outputs gives them."""
    name, client = parsed
    force_responses_reply(monkeypatch, REPLIES[name])
    kw = {"model": MODEL, "input": "Weather?", "tools": FLAT, "max_output_tokens": 300}
    r = client.responses.create(**kw)
    assert r.status == "completed"
    assert [item.type for item in r.output] == ["message"] + ["function_call"] * len(EXPECTED[name])
    assert r.output[0].content[0].text == "Checking."
    assert [(i.name, json.loads(i.arguments)) for i in r.output[1:]] == EXPECTED[name]
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [
        (i.type, getattr(i, "name", None)) for i in r.output
    ]
    assert final.output[0].content[0].text == "Checking."
    streamed = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            streamed[e.output_index] = streamed.get(e.output_index, "") + e.delta
    assert [json.loads(streamed[k]) for k in sorted(streamed)] == [args for _, args in EXPECTED[name]]
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(r.output)
    )
    assert [
        e.item.call_id
        for e in events
        if e.type == "response.output_item.done" and e.item.type == "function_call"
    ] == [i.call_id for i in final.output[1:]]


def test_a_named_call_and_none_are_unchanged_with_a_parser(parsed):
    """A named function (or "required") still holds the reply to the schema; "none" still gives text."""
    _, client = parsed
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=named, max_tokens=50
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert r.choices[0].message.tool_calls is None


def test_kimis_markers_are_special_tokens_kept_in_the_text(make_server):
    """Kimi's markers are special tokens of its tokenizer: a request its parser reads decodes with them (as vLLM
    does); other requests, and other parsers', as they asked."""
    import asyncio

    from kestrel.serve.protocol import ChatCompletionRequest, parse

    for name, kept in (("kimi_k2", True), ("hermes", False)):
        server = make_server(tool_call_parser=name).app.state.server
        for body, reads in (({"messages": CHAT, "tools": TOOLS}, True), ({"messages": CHAT}, False)):
            req = parse(ChatCompletionRequest, json.dumps(body).encode())
            parsers = server.parsers(req, req)
            assert (parsers.tools is not None) == reads
            params = asyncio.run(server.sampling_params(req, {}, parsers))
            assert params.skip_special_tokens == (not (kept and reads))


def test_responses_whole_and_streamed_agree_on_order_and_status(parsed, monkeypatch):
    """Prose after a call: the call item first, then the message, streamed or not; a reply cut in that prose
    leaves the call completed and the message incomplete (the item the cut hit)."""
    name, client = parsed
    if name != "hermes":
        pytest.skip("prose after the calls: Hermes' format")
    text = 'Hm.\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\nDone, now more.'
    force_responses_reply(monkeypatch, text)
    for max_tokens, status in ((300, "completed"), (len(text) - 4, "incomplete")):
        kw = {"model": MODEL, "input": "Time?", "tools": FLAT, "max_output_tokens": max_tokens}
        whole = client.responses.create(**kw)
        streamed = list(client.responses.create(**kw, stream=True))[-1].response
        for r in (whole, streamed):
            assert r.status == status
            assert [(i.type, i.status) for i in r.output] == [
                ("message", status),
                ("function_call", "completed"),
            ]
            assert r.output[0].content[0].text.startswith("Hm.\nDone")


def test_the_servers_own_calls_go_back(parsed):
    """A call as the model wrote it (auto: its arguments not held to JSON, or cut) sent back in the next turn."""
    _, client = parsed
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Os'},
    }
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "cold"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert r.choices[0].finish_reason in ("length", "stop")  # (taken: no 400)
    item = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": "{no",
        "status": "completed",
    }
    out = {"type": "function_call_output", "call_id": "c1", "output": "cold"}
    r = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather?"}, item, out],
        tools=FLAT,
        tool_choice="none",
        max_output_tokens=2,
    )
    assert r.status in ("completed", "incomplete")


def test_parallel_tool_calls_false_keeps_the_first_call(parsed):
    name, client = parsed
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=TOOLS,
        max_tokens=300,
        parallel_tool_calls=False,
        extra_body=_forced(REPLIES[name]),
    )
    assert _calls(r.choices[0].message.tool_calls) == EXPECTED[name][:1]
