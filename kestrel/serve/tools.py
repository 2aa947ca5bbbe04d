"""Tool calls on the chat route and the Responses API, through structured outputs (vLLM's way for `tool_choice`
"required" and a named function): the reply is held to a JSON form and read back as OpenAI's `tool_calls` (chat)
or `function_call` output items (Responses: its flat tools are read through `ToolView`).

- A named function: the reply is that function's arguments, a JSON object following its `parameters` schema.
- "required": the reply is a JSON array of `{"name": ..., "parameters": {...}}`, each item one of the tools
  with its own arguments' schema (one item at most with `parallel_tool_calls: false`).
- "none": a reply in text (the tools still go to the chat template, for templates that show them).
- "auto", the default where tools are given: the model decides, in its own tool-call format, which the server's
  `--tool-call-parser` reads (`kestrel.serve.tool_parsers`); a server without one refuses it with a 400 that says
  what works (the shipped model has no such format).

A reply cut by max_tokens keeps what was written: a named call's partial arguments (as OpenAI's), or, for
"required", the text (its JSON incomplete, no calls read from it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from kestrel.engine.sampling_params import StructuredOutputsParams
from kestrel.serve.errors import bad_request
from kestrel.serve.tool_parsers import ToolCallParser, call_id

# OpenAI's rule for a function's name
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ANY_ARGUMENTS = {"type": "object"}  # a function that declares no parameters: any object


@dataclass
class ToolView:
    """The Responses API's tools as the chat route's: `tools` ChatTool-shaped (`.function.name`,
    `.function.parameters`), `tool_choice` a string or NamedToolChoice-shaped. Its request spells a function's
    fields beside its type (`tools.0.name`, `{"type": "function", "name": ...}`): the errors say so."""

    tools: list[Any] | None
    tool_choice: Any
    parallel_tool_calls: bool | None
    api: str = "responses"  # or "messages" (Anthropic's: `tools.0.input_schema`, tool_choice {"type": "any"})


def _field(req, i: int, name: str) -> str:
    if not isinstance(req, ToolView):
        return f"tools.{i}.function.{name}"
    if req.api == "messages" and name == "parameters":
        return f"tools.{i}.input_schema"
    return f"tools.{i}.{name}"


def check_tools(req) -> None:
    """400s for what the tools and tool_choice of a request cannot mean."""
    tools, choice = req.tools or [], req.tool_choice
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if not _NAME.fullmatch(name):
            raise bad_request(
                f"a function name is 1-64 letters, digits, '_' or '-', not {name!r}",
                param=_field(req, i, "name"),
            )
        if name in names[:i]:
            raise bad_request(f"two tools are named {name!r}", param=_field(req, i, "name"))
    if choice not in (None, "none", "auto") and not tools:
        raise bad_request("tool_choice asks for a tool call, but no tools are given", param="tool_choice")
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise bad_request(
            f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice"
        )
    if tool_calls_asked(req) is not None:
        for i, t in enumerate(tools):
            _check_parameters(t.function.parameters, _field(req, i, "parameters"))


def auto_parser(req, parser: ToolCallParser | None) -> ToolCallParser | None:
    """The parser that reads the reply's calls where the model decides (tool_choice "auto", the default where tools
    are given), None where it does not; a 400 where it would, but the server has no parser."""
    if not req.tools or req.tool_choice not in (None, "auto"):
        return None
    if parser is None:
        api = req.api if isinstance(req, ToolView) else "chat"
        auto, required, none = (
            ('{"type": "auto"}', '{"type": "any"}', '{"type": "none"}')
            if api == "messages"
            else ('"auto"', '"required"', '"none"')
        )
        named = {
            "chat": '{"type": "function", "function": {"name": ...}}',
            "responses": '{"type": "function", "name": ...}',
            "messages": '{"type": "tool", "name": ...}',
        }[api]
        raise bad_request(
            f"tool_choice {auto} needs the model's own tool-call format, and this server reads none (start it with "
            f"--tool-call-parser); give tool_choice {required} or {named} (the reply is then tool calls, their "
            f"arguments held to each schema), or {none}",
            param="tool_choice",
            code="unsupported_value",
        )
    return parser


def _check_parameters(schema: dict | None, param: str) -> None:
    """A function's arguments are a JSON object its schema can hold to: 400s naming the tool's field."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise bad_request(f"a function's parameters are an object, not {schema.get('type')!r}", param=param)
    text = json.dumps(schema)
    if '"$ref": "#"' in text or '"$ref": "#/"' in text:
        raise bad_request("a function's parameters cannot refer to their own root ($ref '#')", param=param)
    try:
        StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise bad_request(str(e), param=param) from None


def tool_calls_asked(req) -> list[str] | None:
    """The functions a chat request's reply calls: all the tools ("required"), the named one, or None (text)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    return [t.function.name for t in req.tools] if choice == "required" else [choice.function.name]


def tool_calls_schema(req) -> dict:
    """The JSON schema the reply follows where tool calls are asked for. For "required" each tool's definitions
    (`$defs`, `definitions`, which pydantic's nested models use) move to the array schema's root, where its
    `#/$defs/...` references resolve; two tools defining one name differently are a 400."""
    params = {t.function.name: t.function.parameters or _ANY_ARGUMENTS for t in req.tools}
    if req.tool_choice != "required":
        return params[req.tool_choice.function.name]
    defs: dict[str, dict] = {}
    items = []
    for i, (name, schema) in enumerate(params.items()):
        schema = dict(schema)
        for key in ("$defs", "definitions"):
            for def_name, definition in (schema.pop(key, None) or {}).items():
                found = defs.setdefault(key, {}).setdefault(def_name, definition)
                if found != definition:
                    raise bad_request(
                        f"two tools define {def_name!r} differently in their {key}",
                        param=_field(req, i, f"parameters.{key}"),
                    )
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
            }
        )
    one = {"anyOf": items} if len(items) > 1 else items[0]
    calls = {"type": "array", "items": one, "minItems": 1, **defs}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return calls


def read_tool_calls(req, text: str, ids: list[str] | None = None, partial: bool = False) -> list[dict] | None:
    """The reply's tool calls as OpenAI's message holds them, or None where none can be read (a "required" reply
    cut before its JSON ended). `ids`: the calls' ids where a stream already gave them. `partial`: such a cut
    reply gives the calls begun whose name is whole, their arguments as far as they came (as the SDKs read a
    stream's partial JSON), not None."""
    if req.tool_choice != "required":
        name = req.tool_choice.function.name
        return [_call(ids[0] if ids else call_id(), name, text)]
    try:
        items = from_json(text, allow_partial=True) if partial else json.loads(text)
    except ValueError:
        return [] if partial else None
    if partial:
        items = (
            [i for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)]
            if isinstance(items, list)
            else []
        )
    return [
        _call(
            ids[i] if ids and i < len(ids) else call_id(), item["name"], _compact(item.get("parameters", {}))
        )
        for i, item in enumerate(items)
    ]


def _call(id_: str, name: str, arguments: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def finish_reason(reason: str | None, stop_reason, calls: list[dict] | None) -> str | None:
    """A choice's finish_reason where its reply is tool calls: "tool_calls" where the grammar ended it (EOS, no
    stop string or stop token: those can cut the arguments short)."""
    return "tool_calls" if calls is not None and reason == "stop" and stop_reason is None else reason
