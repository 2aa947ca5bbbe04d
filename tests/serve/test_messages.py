"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the `anthropic` client, as Claude
Code and the SDK use it: a reply whole and streamed agree (blocks, stop_reason, usage); a conversation of blocks
renders the prompt its chat twin renders; tool_choice any / tool give `tool_use` blocks held to their schemas;
"auto" reads the model's own calls and thinking through the server's parsers; stop sequences; errors in
Anthropic's shape; the key taken as x-api-key."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from kestrel.serve.messages_protocol import MessagesRequest
from tests.serve.conftest import MODEL, RunningServer, force_reply
from tests.serve.test_tools import SCHEMAS, TOOLS

anthropic = pytest.importorskip("anthropic")  # (a dev dependency; the GPU image carries it as a wheel)

KEY = "sk-kestrel-test"
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
    | ({"description": t["function"]["description"]} if "description" in t["function"] else {})
    for t in TOOLS
]
ASK = [{"role": "user", "content": "Weather and time in Oslo?"}]
# Kimi's ids (`functions.NAME:IDX`) as the Messages API sends them: Anthropic's ids are letters, digits, _ and -
KIMI_IDS = ["toolu_enc_ZnVuY3Rpb25zLmdldF93ZWF0aGVyOjA", "toolu_enc_ZnVuY3Rpb25zLmdldF90aW1lOjE"]


@pytest.fixture(scope="module")
def served():
    s = RunningServer(api_key=KEY, tool_call_parser="kimi_k2", reasoning_parser="qwen3")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0, timeout=120)


def _force(monkeypatch, text: str) -> None:
    """The Messages API takes no regex: make its requests' reply `text` (the tiny model writes no tool-call or
    thinking format by itself)."""
    force_reply(monkeypatch, MessagesRequest, text)


def _blocks(message, ids: bool = True) -> list[dict]:
    """The message's content blocks as dicts (`ids` False: a tool_use block's id left out, as ids made here
    differ between two replies)."""
    return [b.model_dump(exclude_none=True, exclude=None if ids else {"id"}) for b in message.content]


def _events(served, body: dict) -> list[tuple[str, dict]]:
    """The raw SSE events of a streamed request: (event name, its JSON)."""
    with httpx.stream(
        "POST",
        f"{served.url}/v1/messages",
        json={**body, "stream": True},
        headers={"x-api-key": KEY},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_text_reply_whole_and_streamed(served, client):
    kw = {"model": MODEL, "max_tokens": 12, "system": "Be brief.", "messages": ASK}
    greedy = {
        "extra_body": {"temperature": 0}
    }  # (the SDK's newest versions dropped the field; the API takes it)
    whole = client.messages.create(**kw, **greedy)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert [b.type for b in whole.content] == ["text"]
    with client.messages.stream(**kw, **greedy) as stream:
        streamed = stream.get_final_message()
    assert _blocks(streamed) == _blocks(whole) and streamed.stop_reason == "max_tokens"
    # the prompt counted as count_tokens counts it: the cache's part as cache_read_input_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=ASK).input_tokens
    for m in (whole, streamed):
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    assert streamed.usage.cache_read_input_tokens > 0  # (the second time: the prompt's pages were cached)
    events = _events(served, {**kw, "temperature": 0})
    start = events[0][1]["message"]["usage"]  # (sent with the first output: the cached part known)
    assert (
        start["input_tokens"] + start["cache_read_input_tokens"] == counted
        and start["cache_read_input_tokens"] > 0
    )
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    text = "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
    assert text == whole.content[0].text


def test_a_conversation_of_blocks_renders_as_its_chat_twin(served, client):
    """System blocks, an assistant turn's thinking, text and tool_use (its id as the Messages API sent it), the
    user's tool_result and text: the prompt the chat route renders for the same conversation (the thinking as
    reasoning_content, the id the model's own)."""
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two tools.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": KIMI_IDS[1], "name": "get_time", "input": {"zone": "CET"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": KIMI_IDS[1],
                    "content": [{"type": "text", "text": "12:00"}],
                },
                {"type": "text", "text": "And the weather?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]
    counted = client.messages.count_tokens(
        model=MODEL, system=system, messages=messages, tools=ANTHROPIC_TOOLS
    )
    chat = [
        {"role": "system", "content": "Be brief.\nUse tools."},
        *ASK,
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two tools.",
            "tool_calls": [
                {
                    "id": "functions.get_time:1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone":"CET"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "12:00"},
        {"role": "user", "content": "And the weather?"},
    ]
    twin = httpx.post(
        f"{served.url}/tokenize",
        json={"model": MODEL, "messages": chat, "tools": TOOLS},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    assert counted.input_tokens == twin["count"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_tool_choice_any_and_a_named_tool_give_tool_use_blocks(client, choice):
    """The calls held to their schemas, whole and streamed alike (the same seed); an "any" reply cut before its
    JSON ended is its text (no call can be read from it)."""
    kw = {"model": MODEL, "max_tokens": 160, "messages": ASK, "tools": ANTHROPIC_TOOLS, "tool_choice": choice}
    seeded = {"extra_body": {"seed": 3, "temperature": 1.0}}
    whole = client.messages.create(**kw, **seeded)
    with client.messages.stream(**kw, **seeded) as stream:
        streamed = stream.get_final_message()
    assert _blocks(streamed, ids=False) == _blocks(whole, ids=False)
    for m in (whole, streamed):
        if m.stop_reason == "max_tokens" and choice["type"] == "any":
            assert [b.type for b in m.content] == ["text"]
            continue
        assert m.stop_reason == "tool_use" and m.content
        for block in m.content:
            assert block.type == "tool_use" and block.id.startswith("call_")
            jsonschema.validate(block.input, SCHEMAS[block.name])
        if choice["type"] == "tool":
            assert [b.name for b in m.content] == ["get_time"]
    single = client.messages.create(
        **{**kw, "tool_choice": {**choice, "disable_parallel_tool_use": True}}, **seeded
    )
    assert single.stop_reason == "tool_use" and len(single.content) == 1


KIMI_REPLY = (
    "<think>Both tools.</think>Checking."
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone":"CET"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)


def test_auto_reads_the_models_thinking_and_calls(served, client, monkeypatch):
    """tool_choice auto (the default with tools): the model's own thinking, prose and calls as thinking, text and
    tool_use blocks in the order written, whole and streamed alike; its ids the model's own, in the form
    Anthropic's pattern allows (Kimi's `functions.NAME:IDX` encoded; read back as written: the test above)."""
    _force(monkeypatch, KIMI_REPLY)
    kw = {"model": MODEL, "max_tokens": 300, "messages": ASK, "tools": ANTHROPIC_TOOLS}
    whole = client.messages.create(**kw)
    expected = [
        {"type": "thinking", "thinking": "Both tools.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {
            "type": "tool_use",
            "id": KIMI_IDS[0],
            "name": "get_weather",
            "input": {"city": "Oslo"},
        },
        {"type": "tool_use", "id": KIMI_IDS[1], "name": "get_time", "input": {"zone": "CET"}},
    ]
    assert _blocks(whole) == expected and whole.stop_reason == "tool_use"
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert _blocks(streamed) == expected and streamed.stop_reason == "tool_use"
    events = _events(served, kw)
    starts = [d["content_block"]["type"] for name, d in events if name == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    deltas = [d["delta"]["type"] for name, d in events if name == "content_block_delta"]
    assert set(deltas) == {"thinking_delta", "text_delta", "input_json_delta"}
    stops = [d["index"] for name, d in events if name == "content_block_stop"]
    assert stops == [0, 1, 2, 3]


def test_calls_cut_by_max_tokens_written_wrong_and_a_stop_sequence(client, monkeypatch):
    """A call the reply's end cut keeps its input as far as it came (an object, as the SDK reads a stream's
    partial JSON), whole and streamed alike; "any" calls cut too; a call whose arguments are not an object's JSON
    has input {} (Anthropic's input is always an object); a stop sequence ends the reply and is named."""
    kw = {"model": MODEL, "messages": ASK, "tools": ANTHROPIC_TOOLS}

    def both(**more):
        whole = client.messages.create(**kw, **more)
        with client.messages.stream(**kw, **more) as stream:
            streamed = stream.get_final_message()
        assert _blocks(streamed, ids=False) == _blocks(whole, ids=False)
        assert streamed.stop_reason == whole.stop_reason
        return whole

    _force(monkeypatch, KIMI_REPLY)
    for at, expected in (("Oslo", {}), ('"}', {"city": "Oslo"})):
        cut = both(
            max_tokens=len(KIMI_REPLY[: KIMI_REPLY.index(at) + 2].encode())
        )  # (the tiny model's tokens: bytes)
        assert cut.stop_reason == "max_tokens"
        assert cut.content[-1].type == "tool_use" and cut.content[-1].input == expected
    cut_calls = '[{"name":"get_weather","parameters":{"city":"Rome"}},{"name":"get_time","parameters":{"zo'
    _force(monkeypatch, cut_calls)
    calls = both(max_tokens=len(cut_calls), tool_choice={"type": "any"})
    assert calls.stop_reason == "max_tokens"
    assert [(b.name, b.input) for b in calls.content] == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    _force(
        monkeypatch,
        "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{zone: CET}<|tool_call_end|>",
    )
    wrong = client.messages.create(**kw, max_tokens=100)
    assert [(b.type, b.name, b.input) for b in wrong.content] == [("tool_use", "get_time", {})]
    _force(monkeypatch, "Sunny in Oslo today.")
    stopped = both(max_tokens=50, stop_sequences=["Oslo"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Oslo"
    assert _blocks(stopped) == [{"type": "text", "text": "Sunny in "}]


def test_turns_of_one_role_are_one_and_a_failed_results_flag(served, client):
    """Consecutive turns of one role render as one (Anthropic combines them); a tool_result's is_error goes to
    the template beside it."""
    split = [
        {"role": "user", "content": "Weather"},
        {"role": "user", "content": [{"type": "text", "text": "now?"}]},
    ]
    counted = client.messages.count_tokens(model=MODEL, messages=split).input_tokens
    twin = httpx.post(
        f"{served.url}/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Weather\nnow?"}]},
        headers={"x-api-key": KEY},
    ).json()
    assert counted == twin["count"]
    request = MessagesRequest.model_validate(
        {
            "max_tokens": 5,
            "messages": [
                *ASK,
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}
                    ],
                },
            ],
        }
    )
    assert request.chat_messages()[-1] == {
        "role": "tool",
        "content": "boom",
        "tool_call_id": "t",
        "is_error": True,
    }


def test_output_format_thinking_and_chat_template_kwargs(client, make_server):
    """The reply held to a JSON schema (on a server without a reasoning parser: with one, a thought may come
    first); `thinking` enabled or disabled reaches a template that switches on it, unless chat_template_kwargs
    says otherwise; chat_template_kwargs taken, the names the renderer sets refused."""
    server = make_server()
    plain = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}}, "required": ["sky"]}
    for key, value in (("output_config", {"format": {"type": "json_schema", "schema": schema}}),
                       ("output_format", {"type": "json_schema", "schema": schema})):  # fmt: skip
        reply = plain.messages.create(model=MODEL, max_tokens=60, messages=ASK, extra_body={key: value})
        assert reply.stop_reason == "end_turn"
        jsonschema.validate(json.loads(reply.content[0].text), schema)
    r = client.messages.count_tokens(model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {"x": 1}})
    assert r.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="chat_template_kwargs.messages"):
        client.messages.count_tokens(
            model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {"messages": 1}}
        )
    server.app.state.server.tokenizer.set_chat_template(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined %}{{ '<think>' if enable_thinking else '<think></think>' }}{% endif %}"
    )

    def counted(**body) -> int:
        return plain.messages.count_tokens(model=MODEL, messages=ASK, **body).input_tokens

    off, on, unsaid = (
        counted(thinking={"type": "disabled"}),
        counted(thinking={"type": "enabled", "budget_tokens": 2048}),
        counted(),
    )
    assert unsaid < on < off
    assert (
        counted(thinking={"type": "disabled"}, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        == on
    )


@pytest.mark.parametrize(
    ("body", "status", "kind", "said"),
    [
        ({"messages": ASK}, 400, "invalid_request_error", "missing required field 'max_tokens'"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "messages.0.content.0.type: 'image' is not supported",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "invalid_request_error",
            "missing required field 'messages.0.content.0.text'",
        ),
        (
            {
                "max_tokens": 5,
                "messages": ASK,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "invalid_request_error",
            "tools.0.type: 'web_search_20250305'",
        ),
        (
            {
                "max_tokens": 5,
                "messages": ASK,
                "tools": [{"name": "f", "input_schema": {"type": "string"}}],
                "tool_choice": {"type": "any"},
            },
            400,
            "invalid_request_error",
            "tools.0.input_schema",
        ),
        (
            {"max_tokens": 5, "messages": ASK, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}},
            400,
            "invalid_request_error",
            "needs the tool's name",
        ),
        ({"max_tokens": 5, "messages": ASK, "container": "c1"}, 400, "invalid_request_error", "container"),
        ({"model": "claude-x", "max_tokens": 5, "messages": ASK}, 404, "not_found_error", "'claude-x'"),
    ],
)
def test_errors_in_anthropics_shape(served, body, status, kind, said):
    r = httpx.post(f"{served.url}/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY})
    assert r.status_code == status
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and said in error["error"]["message"]


def test_the_key_as_x_api_key_auto_without_a_parser_and_more_names(served, make_server):
    wrong = httpx.post(
        f"{served.url}/v1/messages", json={"max_tokens": 5, "messages": ASK}, headers={"x-api-key": "no"}
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    models = httpx.get(f"{served.url}/v1/models", headers={"x-api-key": KEY})
    assert models.status_code == 200  # (every route takes it)
    plain = make_server(
        served_model_names=[MODEL, "claude-haiku-4-5"]
    )  # (the name Claude Code's side tasks ask)
    r = httpx.post(
        f"{plain.url}/v1/messages", json={"max_tokens": 5, "messages": ASK, "tools": ANTHROPIC_TOOLS}
    )
    assert r.status_code == 400 and '{"type": "any"}' in r.json()["error"]["message"]
    ask = {"model": "claude-haiku-4-5", "max_tokens": 3, "messages": ASK}
    reply = httpx.post(f"{plain.url}/v1/messages", json=ask).json()
    assert reply["type"] == "message" and reply["model"] == MODEL  # (replies name the first)
    assert [m["id"] for m in httpx.get(f"{plain.url}/v1/models").json()["data"]] == [
        MODEL,
        "claude-haiku-4-5",
    ]
    missing = httpx.post(f"{plain.url}/v1/messages", json={**ask, "model": "claude-opus"})
    assert missing.status_code == 404 and "'tiny' or 'claude-haiku-4-5'" in missing.json()["error"]["message"]


def test_a_last_assistant_turn_is_the_replys_start(served, client, monkeypatch):
    """Anthropic's prefill: the prompt ends inside the assistant's turn, with its text (as the chat route's
    continue_final_message renders it), and the reply is what follows."""
    messages = [*ASK, {"role": "assistant", "content": "Sunny in"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    twin = httpx.post(
        f"{served.url}/tokenize",
        json={"model": MODEL, "messages": messages, "continue_final_message": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    assert counted == twin["count"]
    new_turn = httpx.post(  # (not the turn closed and another opened after it)
        f"{served.url}/tokenize", json={"model": MODEL, "messages": messages}, headers={"x-api-key": KEY}
    ).json()
    assert counted < new_turn["count"]
    _force(monkeypatch, " Oslo.")
    reply = client.messages.create(model=MODEL, max_tokens=20, messages=messages)
    assert _blocks(reply) == [{"type": "text", "text": " Oslo."}] and reply.stop_reason == "end_turn"
