"""Structured outputs over HTTP, through the `openai` client's own types where it has them: chat's
response_format (json_schema from a pydantic model, json_object), vLLM's structured_outputs and guided_* on chat
and completions, SGLang's /generate json_schema and regex, the Responses API's text.format; streamed or not,
the text follows the grammar. The tiny model's weights are random: its text is the grammar's doing."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from kestrel.engine.sampling_params import StructuredOutputsParams
from tests.serve.conftest import MODEL

CHAT = [{"role": "user", "content": "Give me a record"}]


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(max_length=6)
    legs: int = pydantic.Field(ge=0, le=8)  # integer bounds (minimum, maximum)


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    pets: list[Pet] = pydantic.Field(max_length=2)
    vip: bool | None = None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _followed(pattern: str, text: str, finish_reason: str) -> bool:
    """A match where the output ended by itself; a prefix of one where max_tokens cut it."""
    from kestrel.grammar.regex import Automaton

    a, state = Automaton(pattern), None
    state = a.start
    for b in text.encode("utf-8"):
        state = a.next(state, b)
    return a.accepting(state) if finish_reason == "stop" else state != 0


def test_response_format_json_schema_from_pydantic(client):
    """The openai client's own pydantic path: `parse` sends the model's strict schema and parses the reply."""
    schema = Owner.model_json_schema()
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=120,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "owner", "schema": schema}},
    )
    choice = r.choices[0]
    pattern = StructuredOutputsParams(json=schema).pattern
    assert _followed(pattern, choice.message.content, choice.finish_reason), choice.message.content
    if choice.finish_reason == "stop":
        Owner.model_validate_json(choice.message.content)
    parsed = client.chat.completions.parse(
        model=MODEL, messages=CHAT, max_tokens=200, temperature=0, response_format=Pet
    )
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def test_json_object_streamed_and_not(client):
    kw = dict(
        model=MODEL, messages=CHAT, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert streamed == whole.message.content and whole.message.content.startswith("{")
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(whole.message.content), dict)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, "(?:red|green|blue)"),
        ({"guided_choice": ["yes", "no"]}, "(?:yes|no)"),
        ({"structured_outputs": {"regex": r"\d{2}-[a-z]{3}"}}, r"\d{2}-[a-z]{3}"),
        ({"guided_regex": r"[A-Z][a-z]{1,4}\."}, r"[A-Z][a-z]{1,4}\."),
    ],
)
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_vllm_fields_on_both_routes(client, extra, pattern, route):
    kw = dict(model=MODEL, max_tokens=20, temperature=1.0, seed=7, n=3, extra_body=extra)
    if route == "chat":
        choices = client.chat.completions.create(messages=CHAT, **kw).choices
        texts = [(c.message.content, c.finish_reason) for c in choices]
    else:
        choices = client.completions.create(prompt="Colour:", **kw).choices
        texts = [(c.text, c.finish_reason) for c in choices]
    for text, reason in texts:
        assert reason == "stop" and re.fullmatch(pattern, text), text


def test_guided_json_schema_text(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=30, temperature=0, extra_body={"guided_json": json.dumps(schema)}
    )
    c = r.choices[0]
    assert _followed(StructuredOutputsParams(json=schema).pattern, c.text, c.finish_reason)
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.text), schema)


def test_native_generate_json_schema_and_regex(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for sp, check in (
        ({"json_schema": json.dumps(schema)}, lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
        ({"regex": "(?:ab|cd)+!"}, lambda t: re.fullmatch("(?:ab|cd)+!", t)),
    ):
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 40, "temperature": 0.5, **sp}}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert check(out["text"]), out["text"]


def test_responses_text_format(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    r = client.responses.create(
        model=MODEL, input="Where?", max_output_tokens=30, temperature=0, text={"format": fmt}
    )
    assert r.status == "completed" and json.loads(r.output_text)["city"] in ("Oslo", "Rome")
    assert r.text.format.type == "json_schema" and r.text.format.name == "place"
    events = list(
        client.responses.create(
            model=MODEL,
            input="Where?",
            max_output_tokens=30,
            temperature=0,
            text={"format": fmt},
            stream=True,
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    obj = client.responses.create(
        model=MODEL, input="x", max_output_tokens=40, temperature=0, text={"format": {"type": "json_object"}}
    )
    assert obj.output_text.startswith("{")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "not": {}}},
                }
            },
            "response_format.json_schema.schema",
        ),  # fmt: skip
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"guided_choice": ["a"], "allowed_token_ids": [65]}, "allowed_token_ids"),
        # the engine's errors (a pattern too large or too ambiguous) name the field the client sent
        ({"guided_regex": "x{99999999}"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(?:[a-z]{1,200}){1,200}"}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "string", "maxLength": 10**6}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}}, "response_format"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_native_and_responses_errors(server):
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex", r.text
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": MODEL, "input": "a", "text": {"format": {"type": "json_schema", "name": "x"}}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema", r.text
    r = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": MODEL, "input": "a", "text": {"format": {"type": "json_object", "schema": {}}}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": "a", "sampling_params": {"regex": "(?:[0-9]{1,100}){1,100}"}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex", r.text
    assert "too ambiguous" in r.json()["error"]["message"]
