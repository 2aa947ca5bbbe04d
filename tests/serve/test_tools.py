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


# the Responses API's function tools: flat (name and parameters beside type)
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]


def _check_items(output, status, names=None):
    assert output and all(item.type == "function_call" for item in output)
    for item in output:
        assert item.call_id.startswith("call_") and item.id.startswith("fc_") and item.status == status
        assert item.name in (names or SCHEMAS)
        if status == "completed":
            jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


@pytest.mark.parametrize(
    ("tool_choice", "names"), [({"type": "function", "name": "get_time"}, ["get_time"]), ("required", None)]
)
def test_responses_function_calls(client, tool_choice, names):
    """The Responses API: tool_choice named or "required" gives `function_call` output items, their arguments
    held to each function's schema; streamed, the events give the same items (a named call's arguments in
    deltas that add up to them)."""
    kw = dict(
        model=MODEL, input="Weather in Oslo?", tools=FLAT, tool_choice=tool_choice, temperature=0,
        max_output_tokens=80,
    )  # fmt: skip
    r = client.responses.create(**kw)
    _check_items(r.output, r.status, names)
    assert r.tools[0].name == "get_weather" and r.status == "completed"
    if names:
        assert len(r.output) == 1
    events = list(client.responses.create(stream=True, **kw))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in r.output]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [o.model_dump() for o in done] == [o.model_dump() for o in final.output]
    for item in final.output:
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == item.id
        ]
        assert "".join(deltas) == item.arguments
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.call_id for e in added] == [o.call_id for o in final.output]


def test_responses_conversation_with_calls_and_their_outputs(client, server):
    """The calls a reply made and their outputs, sent back as input items (as the client dumps them), reach the
    chat template as an assistant turn's tool_calls and tool turns; tool_choice "none" gives text."""
    kw = dict(model=MODEL, tools=FLAT, temperature=0, max_output_tokens=80)
    first = client.responses.create(input="Weather in Oslo?", tool_choice="required", **kw)
    assert first.status == "completed" and first.output[0].type == "function_call"
    turns = [
        {"role": "user", "content": "Weather in Oslo?"},
        *[o.model_dump(mode="json") for o in first.output],  # as the client dumps them (async_, caller: None)
        *[{"type": "function_call_output", "call_id": o.call_id, "output": "sunny"} for o in first.output],
    ]
    again = client.responses.create(input=turns, tool_choice="none", **kw)
    assert again.output[0].type == "message" and again.usage.input_tokens > first.usage.input_tokens
    # the route's rendering is chat's for the same conversation: the prompts' token counts agree
    chat = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}}
                for o in first.output
            ],
        },
        *[{"role": "tool", "tool_call_id": o.call_id, "content": "sunny"} for o in first.output],
    ]
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL, "messages": chat, "tools": TOOLS}
    ).json()
    assert again.usage.input_tokens == tokens["count"]


def test_responses_a_cut_call_sent_back_is_taken(client):
    """A named call cut by max_output_tokens (its arguments not JSON yet, status incomplete) goes back into the
    input as the client holds it: taken as its text, not refused."""
    kw = dict(model=MODEL, tools=FLAT, temperature=0)
    cut = client.responses.create(
        input="Weather?", tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=3, **kw
    )
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    with pytest.raises(ValueError):
        json.loads(cut.output[0].arguments)
    turns = ["Weather?", *cut.output]
    again = client.responses.create(
        input=[{"role": "user", "content": turns[0]}, *[o.model_dump(mode="json") for o in turns[1:]]],
        tool_choice="none",
        max_output_tokens=4,
        **kw,
    )
    assert again.output[0].type == "message"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": FLAT}, "tool_choice", "auto"),  # the default with tools
        ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among"),
        (
            {"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"},
            "tools.0.name",
            "1-64",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "expected 'function'"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools.0.name", "missing"),
        (
            {"tools": FLAT, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
            "text.format",
            "give one of",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "missing"),
        (
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input.0.type",
            "'item_reference' is not supported",
        ),
        ({"message": "x"}, "message", "unknown field"),  # (an item kind's name, outside the input's items)
        ({"input": [{"role": "user", "content": "x", "message": 1}]}, "input.0.message", "unknown field"),
    ],
)
def test_bad_responses_tool_requests_are_400s(server, body, param, says):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
