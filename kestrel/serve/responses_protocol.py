"""Request bodies of OpenAI's Responses API (`POST /v1/responses`): its input items (messages, earlier function
calls and their outputs), its flat function tools, `text.format`; parsed as strictly as the other routes'
(`kestrel.serve.protocol`), with which it shares the chat template's messages and the tool calls
(`kestrel.serve.tools`)."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from kestrel.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.serve.errors import bad_request
from kestrel.serve.protocol import (
    ChatTool,
    FunctionDefinition,
    Int,
    NamedFunction,
    NamedToolChoice,
    _arguments,
    _FieldError,
    _format_constraint,
    _refuse_unsupported,
    _Strict,
    _structured,
    _template_message,
    _template_tools,
    make_sampling_params,
)
from kestrel.serve.tools import ToolView, check_tools, tool_calls_asked, tool_calls_schema


class ResponseTextFormat(_Strict):
    """The Responses API's `text.format`: text, JSON mode, or JSON following a schema (its fields beside `type`,
    not under `json_schema` as in chat's response_format)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "json_schema" and self.schema_ is None:
            raise bad_request("a json_schema format needs its schema", param="text.format.schema")
        if self.type != "json_schema" and (self.schema_, self.name, self.strict) != (None, None, None):
            raise bad_request(
                f"name, schema and strict are only taken with type json_schema, not {self.type}",
                param="text.format",
            )
        return _format_constraint(self.type, self.schema_, "text.format", "text.format.schema")


class ResponseTextConfig(_Strict):
    format: ResponseTextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without that training has


class ResponseTextPart(_Strict):
    """A text part of a Responses API input message: the user's `input_text`, or an earlier reply's
    `output_text` (as the API returned it: its annotations and logprobs are taken and not used)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponseInputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ResponseTextPart]
    # what the API puts on an earlier reply's message item when it is sent back: taken, not used
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class ReasoningSettings(_Strict):
    """The request's `reasoning` (what the Codex CLI and the Agents SDK send to thinking models): taken, not
    used; how much a model thinks is its own (or its template's: chat_template_kwargs on the chat route)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseFunctionTool(_Strict):
    """A Responses API function tool: its fields beside `type` (the chat route nests them under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # taken either way: the arguments always follow the schema

    def as_chat(self) -> ChatTool:
        fields = self.model_dump(exclude={"type"})
        return ChatTool(type="function", function=FunctionDefinition(**fields))


class ResponseNamedToolChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponseFunctionCall(_Strict):
    """An input item: a call an earlier reply made (as the API returned it, and as the openai client dumps it:
    its `async`, `caller` and `namespace` are taken, not used)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    async_: bool | None = Field(None, alias="async")
    caller: dict[str, Any] | None = None
    namespace: str | None = None


class ResponseFunctionCallOutput(_Strict):
    """An input item: a call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ResponseReasoning(_Strict):
    """An input item: an earlier reply's reasoning (as the API returned it; OpenAI asks clients to send it back),
    given to the chat template as the next assistant turn's `reasoning_content`."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # (none is made here: taken, not used)
    status: str | None = None


def _item_kind(item) -> str:
    """A Responses input item's kind: its `type` (a message may leave it out)."""
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"


# an input item, told apart by its type (so that a flaw is reported against its own kind's fields)
ResponseInputItem = Annotated[
    Annotated[ResponseInputMessage, Tag("message")]
    | Annotated[ResponseFunctionCall, Tag("function_call")]
    | Annotated[ResponseFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponseReasoning, Tag("reasoning")],
    Discriminator(_item_kind),
]


class ResponsesRequest(_Strict):
    """OpenAI's Responses API (`POST /v1/responses`), stateless: `input` (a string, or messages, earlier function
    calls and their outputs, earlier reasoning), `instructions` (a system message first), `max_output_tokens`,
    `temperature`, `top_p`, `stream`, structured output (`text.format`) and function tools (`tools`, `tool_choice`
    "required" or a named function: the reply is `function_call` items, as on the chat route,
    `kestrel.serve.tools`; "auto" where the server has a tool-call parser). Nothing is stored (`store` is taken
    and the response cannot be fetched later; `reasoning` settings are taken, not used); other tool types and
    `previous_response_id` are refused unless given their neutral value."""

    model: str | None = None
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`: taken, not used
    # a routing hint for OpenAI's cache: taken (this server's cache needs none)
    prompt_cache_key: str | None = None
    stream_options: Any = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: Any = None
    reasoning: ReasoningSettings | None = None
    text: ResponseTextConfig | None = None
    include: Any = None
    truncation: Any = None
    background: Any = None
    service_tier: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    def check(self) -> None:
        _refuse_unsupported(self, _NEUTRAL_RESPONSES)
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be empty", param="input")
        check_tools(self.tool_view)
        if self.tool_calls_asked is not None and self._text_constraint() is not None:
            raise bad_request(
                "give one of tools (tool_choice asks for calls) and text.format", param="text.format"
            )

    @functools.cached_property
    def tool_view(self) -> ToolView:
        """The tools and tool_choice as `kestrel.serve.tools` reads the chat route's."""
        choice = self.tool_choice
        if isinstance(choice, ResponseNamedToolChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        tools = [t.as_chat() for t in self.tools] if self.tools else None
        return ToolView(tools, choice, self.parallel_tool_calls)

    @property
    def tool_calls_asked(self) -> list[str] | None:
        return tool_calls_asked(self.tool_view)

    def template_options(self) -> dict:
        """apply_chat_template's keyword arguments: the tools too, for templates that show them."""
        return {"add_generation_prompt": True, "tools": _template_tools(self.tool_view.tools)}

    def chat_messages(self) -> list[dict]:
        """The conversation the chat template renders: the instructions as a system message, then the input (an
        earlier reply's function calls as an assistant turn's tool_calls, their outputs as tool turns)."""
        system = [_template_message("system", self.instructions)] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*system, _template_message("user", self.input)]
        out = system
        reasoning = None  # a reasoning item's text, for the assistant turn after it
        for item in self.input:
            if isinstance(item, ResponseReasoning):
                reasoning = "".join(part.text for part in item.content or item.summary or [])
                continue
            if isinstance(item, ResponseFunctionCall):
                args = _arguments(item.arguments)
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": args},
                }
                if out and out[-1].get("tool_calls"):  # calls made together: one assistant turn
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({**_template_message("assistant", None), "tool_calls": [call]})
            elif isinstance(item, ResponseFunctionCallOutput):
                out.append({**_template_message("tool", item.output), "tool_call_id": item.call_id})
            else:
                # (the parts' texts joined with newlines, as the tokenizer joins a chat message's text parts)
                text = (
                    item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
                )
                out.append(_template_message(item.role, text))
            if reasoning is not None and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], reasoning = reasoning, None
        return out

    @property
    def _format(self) -> ResponseTextFormat | None:
        return self.text.format if self.text is not None else None

    def _text_constraint(self) -> str | None:
        fmt = self._format
        if fmt is None or fmt.type == "text":
            return None
        return "text.format.schema" if fmt.type == "json_schema" else "text.format"

    @property
    def constraint_field(self) -> str | None:
        return "tools" if self.tool_calls_asked is not None else self._text_constraint()

    def text_format(self) -> dict:
        """`text.format` as the response echoes it."""
        fmt = self._format
        return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)

    def to_sampling_params(self) -> SamplingParams:
        structured = self._format.structured() if self._format is not None else None
        if self.tool_calls_asked is not None:
            structured = _structured("tools", json=tool_calls_schema(self.tool_view))
        given = {"temperature": self.temperature, "top_p": self.top_p, "structured_outputs": structured}
        try:
            return make_sampling_params(
                max_tokens=self.max_output_tokens, **{k: v for k, v in given.items() if v is not None}
            )
        except _FieldError as e:
            raise e.as_request_error({"max_tokens": "max_output_tokens"}) from None


_NEUTRAL_RESPONSES: dict[str, tuple] = {
    "previous_response_id": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}),  # no obfuscation padding is sent
    # (a reasoning item's encrypted_content, which clients that keep no state ask for: none is made, it stays null)
    "include": (None, [], ["reasoning.encrypted_content"]),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "service_tier": (None, "auto", "default"),
    "prompt": (None,),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}
