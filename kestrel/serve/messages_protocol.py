"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), which Claude
Code and the `anthropic` SDK speak: a system prompt, turns whose content is a string or blocks (text, an earlier
reply's thinking and `tool_use` blocks, the user's `tool_result` blocks), tools with an `input_schema`, and
`tool_choice` auto / any / tool / none. Parsed as strictly as the other routes' (`kestrel.serve.protocol`); the
turns become the chat template's messages (a `tool_use` an assistant turn's tool call, a `tool_result` a tool turn)
and the tools the chat route's, so that the tool calls and their parsers are the same (`kestrel.serve.tools`).

Blocks are told apart by their `type` and each is checked against its own kind's fields, so that an image or a
server tool is refused by name. `cache_control` marks are taken and not needed: the prefix cache finds the shared
prefix itself. `thinking` enabled or disabled reaches the chat template as the switches thinking models' templates
read (`enable_thinking`, `thinking`); its budget is not held to.
"""

from __future__ import annotations

import base64
import functools
import itertools
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kestrel.engine.sampling_params import SamplingParams
from kestrel.serve.errors import APIError, bad_request, from_validation_error
from kestrel.serve.protocol import (
    ChatTool,
    FunctionDefinition,
    Int,
    NamedFunction,
    NamedToolChoice,
    _check_template_kwargs,
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


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: Any = None
    citations: list[Any] | None = None  # (an earlier reply's, sent back: none are made here)


class ThinkingBlock(_Strict):
    """An earlier reply's thinking, sent back: the next assistant turn's `reasoning_content` for the template."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # (none is made here: taken, not checked)


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str  # (none is made here: taken, not rendered)


class ToolUseBlock(_Strict):
    """An earlier reply's call: its `input` as the server returned it (an object; the model's text where that did
    not parse as one)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: Any
    cache_control: Any = None
    caller: Any = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: Any = None


_BLOCKS: dict[str, type[BaseModel]] = {
    "text": TextBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
}
# the kinds each role's turn may hold
_ROLE_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "thinking", "redacted_thinking", "tool_use"),
}


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Strict):
    """A client tool (`type` "custom" or left out); Anthropic's server tools (web search, code execution, ...)
    are refused by name."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None
    strict: bool | None = None  # taken either way: where calls are asked for, the input follows the schema
    # hints to Anthropic's own serving: taken, not used
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[Any] | None = None
    allowed_callers: list[Any] | None = None

    def as_chat(self) -> ChatTool:
        function = FunctionDefinition(
            name=self.name, description=self.description, parameters=self.input_schema
        )
        return ChatTool(type="function", function=function)


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # taken, not used


class MessagesRequest(_Strict):
    """Anthropic's Messages API: `max_tokens` (required), `system`, `messages`, `stop_sequences`, `temperature`,
    `top_p`, `top_k`, `stream`, `tools` and `tool_choice` ("any" and a named tool make the reply calls held to
    their schemas, as the chat route's "required" and named function; "auto", the default where tools are given,
    needs the server's tool-call parser), `output_config.format` (JSON following a schema; `output_format`, its
    beta name) and, beyond Anthropic's fields, `seed` and `chat_template_kwargs` (vLLM's: such as
    `enable_thinking`). `thinking` enabled or disabled is given to the template (`_template_kwargs`); `metadata`,
    `service_tier` and `cache_control` are taken, not used; fields
    for Anthropic's own platform (containers, MCP servers, context management) are refused unless given their
    neutral value."""

    model: str | None = None
    messages: list[AnthropicMessage]
    max_tokens: Int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    seed: Int | None = None  # (an extension, as vLLM's routes take it: a sampled reply made again)
    chat_template_kwargs: dict[str, Any] | None = None  # (an extension, vLLM's)
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # (its name in Anthropic's structured-outputs beta)
    metadata: dict[str, Any] | None = None
    cache_control: Any = None
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    inference_geo: Any = None
    speed: Any = None

    def check(self) -> None:
        _refuse_unsupported(self, _NEUTRAL_MESSAGES)
        _check_template_kwargs(self.chat_template_kwargs)
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        check_tools(self.tool_view)
        if self.output_format is not None and self.output_config is not None and self.output_config.format:
            raise bad_request("give one of output_config.format and output_format", param="output_format")
        if self.tool_calls_asked is not None and self._format is not None:
            raise bad_request(
                f"give one of tools (tool_choice asks for calls) and {self._format_field}",
                param=self._format_field,
            )

    @functools.cached_property
    def blocks(self) -> list[list]:
        """Each turn's content as its blocks (a string: one text block), each checked against its kind."""
        out = []
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append([TextBlock(type="text", text=m.content)])
                continue
            allowed = _ROLE_BLOCKS[m.role]
            turn = []
            for j, block in enumerate(m.content):
                kind, path = block.get("type"), f"messages.{i}.content.{j}"
                if kind not in allowed:
                    raise bad_request(
                        f"{path}.type: {kind!r} is not supported in {m.role!r} turns by this server; expected one "
                        f"of {', '.join(map(repr, allowed))}",
                        param=f"{path}.type",
                        code="unsupported_value",
                    )
                turn.append(_parse_block(_BLOCKS[kind], block, path))
            out.append(turn)
        return out

    @functools.cached_property
    def parsed_tools(self) -> list[AnthropicTool] | None:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise bad_request(
                    f"tools.{i}.type: {kind!r} (a tool Anthropic's platform runs) is not supported by this "
                    "server; give client tools (a name and an input_schema)",
                    param=f"tools.{i}.type",
                    code="unsupported_value",
                )
            out.append(_parse_block(AnthropicTool, tool, f"tools.{i}"))
        return out

    @functools.cached_property
    def tool_view(self) -> ToolView:
        """The tools and tool_choice as `kestrel.serve.tools` reads the chat route's: any -> "required", a named
        tool -> that function, auto and none as they are; disable_parallel_tool_use -> parallel_tool_calls false."""
        choice, parallel = self.tool_choice, None
        if choice is not None:
            parallel = False if choice.disable_parallel_tool_use else None
            if choice.type == "tool":
                if choice.name is None:
                    raise bad_request(
                        'tool_choice of type "tool" needs the tool\'s name', param="tool_choice.name"
                    )
                choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
            else:
                choice = {"any": "required"}.get(choice.type, choice.type)
        tools = [t.as_chat() for t in self.parsed_tools] if self.parsed_tools else None
        return ToolView(tools, choice, parallel, api="messages")

    @property
    def tool_calls_asked(self) -> list[str] | None:
        return tool_calls_asked(self.tool_view)

    @property
    def _format(self) -> JsonOutputFormat | None:
        given = self.output_config.format if self.output_config is not None else None
        return given if given is not None else self.output_format

    @property
    def _format_field(self) -> str:
        return "output_format" if self.output_format is not None else "output_config.format"

    @property
    def constraint_field(self) -> str | None:
        if self.tool_calls_asked is not None:
            return "tools"
        return f"{self._format_field}.schema" if self._format is not None else None

    def template_options(self) -> dict:
        """apply_chat_template's keyword arguments: the tools too; a last turn of the assistant's is continued (its
        text the reply's start, Anthropic's prefill: the reply is what follows it)."""
        prefill = self.messages[-1].role == "assistant"
        return {
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
            "tools": _template_tools(self.tool_view.tools),
            "chat_template_kwargs": self._template_kwargs(),
        }

    def _template_kwargs(self) -> dict | None:
        """chat_template_kwargs, with `thinking` enabled or disabled given to the templates that switch it
        (Qwen 3's `enable_thinking`, DeepSeek V3.1's `thinking`; others ignore both) unless the request's own
        chat_template_kwargs set them."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return self.chat_template_kwargs
        on = self.thinking.type == "enabled"
        return {"enable_thinking": on, "thinking": on, **(self.chat_template_kwargs or {})}

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        parts = [_parse_block(TextBlock, block, f"system.{j}") for j, block in enumerate(self.system)]
        return "\n".join(p.text for p in parts)

    def chat_messages(self) -> list[dict]:
        """The conversation the chat template renders: the system prompt first; consecutive turns of one role as
        one (as Anthropic combines them); an assistant turn's text, its thinking as `reasoning_content` and its
        `tool_use` blocks as tool_calls; a user turn's `tool_result` blocks as tool turns (before its text, as
        Anthropic has them first; `is_error` kept beside the result, for templates that read it)."""
        system = self.system_text()
        out = [_template_message("system", system)] if system is not None else []
        for role, turns in itertools.groupby(zip(self.messages, self.blocks), key=lambda turn: turn[0].role):
            blocks = [b for _, turn in turns for b in turn]
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if role == "assistant":
                message = _template_message("assistant", "".join(texts))
                thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
                if thinking:
                    message["reasoning_content"] = "".join(thinking)
                calls = [_call(b) for b in blocks if isinstance(b, ToolUseBlock)]
                if calls:
                    message["tool_calls"] = calls
                out.append(message)
                continue
            results = [b for b in blocks if isinstance(b, ToolResultBlock)]
            for b in results:
                content = (
                    b.content if not isinstance(b.content, list) else "\n".join(p.text for p in b.content)
                )
                out.append(
                    {**_template_message("tool", content or ""), "tool_call_id": model_id(b.tool_use_id)}
                )
                if b.is_error:
                    out[-1]["is_error"] = True
            if texts or not results:
                out.append(_template_message("user", "\n".join(texts)))
        return out

    def to_sampling_params(self) -> SamplingParams:
        structured = None
        if self.tool_calls_asked is not None:
            structured = _structured("tools", json=tool_calls_schema(self.tool_view))
        elif self._format is not None:
            structured = _format_constraint(
                "json_schema", self._format.schema_, self._format_field, f"{self._format_field}.schema"
            )
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop_sequences,
            "structured_outputs": structured,
        }
        try:
            return make_sampling_params(
                max_tokens=self.max_tokens, **{k: v for k, v in given.items() if v is not None}
            )
        except _FieldError as e:
            raise e.as_request_error({"stop": "stop_sequences"}) from None


def _call(block: ToolUseBlock) -> dict:
    """A `tool_use` block as the chat template's tool call (its input as the object it is; its id the model's
    own again)."""
    return {
        "id": model_id(block.id),
        "type": "function",
        "function": {"name": block.name, "arguments": block.input},
    }


# Anthropic's tool_use ids are letters, digits, `_` and `-`; a model's own (Kimi's `functions.NAME:IDX`) is sent
# as this prefix and its base64url form, and read back as it was (its template writes it beside the result)
_ANTHROPIC_ID = re.compile(r"[A-Za-z0-9_-]+")
_ENCODED_ID = "toolu_enc_"


def anthropic_id(call_id: str) -> str:
    """A call's id as Anthropic's pattern allows it: as it is where it fits, else encoded (`model_id` decodes)."""
    if _ANTHROPIC_ID.fullmatch(call_id) and not call_id.startswith(_ENCODED_ID):
        return call_id
    return _ENCODED_ID + base64.urlsafe_b64encode(call_id.encode()).decode().rstrip("=")


def model_id(sent: str) -> str:
    """An id a client sent back (`tool_use.id`, `tool_result.tool_use_id`) as the model wrote it."""
    if not sent.startswith(_ENCODED_ID):
        return sent
    data = sent[len(_ENCODED_ID) :]
    try:
        return base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return sent


def _parse_block(model: type[BaseModel], block, path: str):
    """`block` (a JSON object of the request at `path`) as `model`; its first flaw a 400 named by its full path."""
    if not isinstance(block, dict):
        raise bad_request(f"{path}: expected an object", param=path, code="invalid_type")
    try:
        return model.model_validate(block)
    except ValidationError as e:
        err = from_validation_error(e)
    param = f"{path}.{err.param}" if err.param else path
    message = err.message.replace(err.param, param, 1) if err.param else f"{path}: {err.message}"
    raise APIError(400, message, param=param, code=err.code)


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: the same request without `max_tokens`, answered with the prompt's token
    count."""

    max_tokens: Int | None = None


_NEUTRAL_MESSAGES: dict[str, tuple] = {
    "service_tier": (None, "auto", "standard_only"),
    "container": (None,),
    "mcp_servers": (None, []),
    "context_management": (None,),
    "inference_geo": (None,),
    "speed": (None, "standard"),
}
