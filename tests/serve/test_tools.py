"""Tool calls through the `openai` client: tool_choice "required" or a named function gives OpenAI's tool_calls,
their arguments held to each function's schema (structured outputs); streamed, the deltas add up to the same
calls; "none" gives text; "auto" and malformed tools are 400s that say why; a conversation carrying earlier
calls and their results is taken."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL

CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _check_calls(message, finish_reason, names=None):
    assert finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60
    )
    c = r.choices[0]
    _check_calls(c.message, c.finish_reason, ["get_time"])
    assert len(c.message.tool_calls) == 1


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_one_or_more_of_the_tools(client, parallel):
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=3,
        max_tokens=120, **kw,
    )  # fmt: skip
    for c in r.choices:
        if c.finish_reason == "length":
            assert c.message.content and not c.message.tool_calls  # cut before its JSON ended: the text
            continue
        _check_calls(c.message, c.finish_reason)
        if parallel is False:
            assert len(c.message.tool_calls) == 1


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_calls_add_up_to_the_whole_response(client, tool_choice):
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function.name if d.function else None) or call["name"]
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert reason == whole.finish_reason
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert got == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_none_gives_text_and_history_with_calls_is_taken(client):
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=5
    )
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"tools": TOOLS}, "tool_choice", "auto"),  # auto is the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "auto"),
        ({"tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
            "tools.0.function.name",
            "letters",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools.1.function.name", "two tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "give one",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "not": {}}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
            "not",
        ),  # fmt: skip
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools.0.function.parameters",
            "an object",
        ),  # fmt: skip
        (
            {
                "messages": [
                    *CHAT,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{not json"},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
            "JSON",
        ),  # fmt: skip
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "needs"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
            "messages.0.tool_call_id",
            "only",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        # an object tool_choice's own flaw, not the strings a tool_choice may also be
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "missing"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "missing",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.type", "expected 'function'"),
        ({"tools": TOOLS, "tool_choice": "bogus"}, "tool_choice", "expected 'none', 'auto' or 'required'"),
    ],
)
def test_bad_tool_requests_are_400s(server, body, param, says):
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_the_clients_own_message_goes_back_as_it_dumps_it(client):
    """An agent loop appends the returned message (`model_dump()`: refusal, annotations, audio, function_call as
    None; a streamed one's calls with their index) and the tool's answer, and asks again."""
    kw = dict(model=MODEL, tools=TOOLS, temperature=0, max_tokens=60)
    first = client.chat.completions.create(messages=CHAT, tool_choice="required", **kw).choices[0].message
    dumped = first.model_dump()
    assert "refusal" in dumped and "annotations" in dumped
    dumped["tool_calls"][0]["index"] = 0
    answer = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "12 C"}
    again = client.chat.completions.create(messages=[*CHAT, dumped, answer], tool_choice="none", **kw)
    assert isinstance(again.choices[0].message.content, str)


def test_required_with_pydantic_defs(client):
    """Nested pydantic models refer to `#/$defs/...`: under "required" the definitions move to the root, where
    those references resolve (they had been a 400)."""
    address = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
    person = {
        "$defs": {"Address": address},
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/Address"}},
        "required": ["home"],
    }
    tools = [{"type": "function", "function": {"name": "save", "parameters": person}}, TOOLS[1]]
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=tools, tool_choice="required", temperature=0, max_tokens=80,
        parallel_tool_calls=False,
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    call = c.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), person if call.function.name == "save" else TIME)


def test_a_call_cut_by_a_stop_string_is_not_reported_whole(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60, stop=[","]
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == "," and c.message.tool_calls


def test_required_calls_stream_before_their_finish(client):
    """The calls come in a chunk of their own, the finish in the next (openai-python's stream helpers close a
    call's arguments only so)."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
            parallel_tool_calls=False, stream=True,
        )
    )  # fmt: skip
    with_calls = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.tool_calls]
    finish = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].finish_reason]
    assert len(with_calls) == 1 and finish == [with_calls[0] + 1]
    assert chunks[finish[0]].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices and ch.choices[0].delta.content for ch in chunks)


def test_a_template_that_shows_tools_gets_them_everywhere(make_server):
    """A chat template that renders the tools and earlier calls: the chat route's prompt and /tokenize's are the
    same text, the calls' arguments rendered as objects."""
    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}:{{ t.function.parameters | tojson }}]{% endfor %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.name }}{{ c.function.arguments | tojson }}){% endfor %}"
        "{% endfor %}<assistant>"
    )
    s = make_server(chat_template=template)
    messages = [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]  # fmt: skip
    tools = [TOOLS[1], {"type": "function", "function": {"name": "ping"}}]
    body = {"model": MODEL, "messages": messages, "tools": tools}
    tok = httpx.post(f"{s.url}/tokenize", json=body, timeout=30).json()
    text = s.engine.tokenizer.decode(tok["tokens"])
    assert text.startswith('[get_time:{"type": "object", "properties": {"zone"')
    assert '[ping:{"type": "object", "properties": {}}]' in text
    assert '(get_time{"zone": "UTC"})' in text and text.endswith("<tool>noon<assistant>")
    chat = httpx.post(
        f"{s.url}/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2}, timeout=30
    ).json()
    assert chat["usage"]["prompt_tokens"] == tok["count"]
