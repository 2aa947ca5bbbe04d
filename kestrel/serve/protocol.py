"""Request bodies: OpenAI chat and text completions, vLLM's /tokenize and /detokenize, and the native `/generate`
(SGLang-style sampling dict); OpenAI's Responses API's are in `kestrel.serve.responses_protocol`, built on these.

Parsing is strict: unknown fields, wrong JSON types (a string for a number, true for an integer) and fields
this server does not implement are refused with a 400 that names the field, never silently ignored; a field
that asks for nothing this server lacks is taken (the Responses API's `store`, whose responses are never kept
anyway, `metadata`, echoed, and the ids of earlier replies sent back). A JSON number with a whole value is a
whole number (`max_tokens: 4.0` is 4, a prompt's `[1.0, 2.0]` is [1, 2], as JSON and vLLM's parsing have it; 4.5
is refused). Value ranges are checked once, by `SamplingParams`. Optional OpenAI
fields accept null as "not given".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kestrel.chat_template import check_template_kwargs
from kestrel.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.serve.errors import bad_request, from_validation_error
from kestrel.serve.tools import check_tools, tool_calls_asked, tool_calls_schema

MAX_N = 128


def _whole(value):
    """A float with a whole value as the int it is (Python's json writes 4.0 for a float that holds 4);
    anything else as it came, for the strict int check to take or refuse."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# A whole-number field: an int, or a float with a whole value.
Int = Annotated[int, BeforeValidator(_whole)]


def _logit_bias(value: dict[str, float] | None, param: str) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose JSON keys are strings ({"50256": -100}), with its keys as token ids."""
    if value is None:
        return None
    bad = next((k for k in value if not (k.isascii() and k.isdigit() and len(k) <= 10)), None)
    if bad is not None:
        raise bad_request(
            f"logit_bias keys must be token ids written as at most 10 digits, not {bad!r}", param=param
        )
    bias: dict[int, float] = {}
    for k, v in value.items():
        if int(k) in bias:
            twice = next(other for other in value if other != k and int(other) == int(k))
            raise bad_request(f"logit_bias names token {int(k)} twice (as {twice!r} and {k!r})", param=param)
        bias[int(k)] = v
    return bias


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def check(self) -> None:
        """What the types alone do not say, checked after parsing (`parse`); nothing by default."""


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI's
    parsed_arguments: Any = None  # what the openai client's parse() adds: taken, not used


class ToolCall(_Strict):
    """A tool call of an earlier assistant turn, sent back with the conversation (as the openai client dumps it:
    a streamed message's calls keep their `index`)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: Int | None = None


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system" and is rendered as one.
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    # OpenAI's participant name: accepted, not rendered (the chat template has no place for it)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (SDKs send [] for none)
    tool_call_id: str | None = None  # a tool turn's: the call it answers
    # an assistant turn's reasoning, as a reasoning parser returned it (SGLang's name and vLLM's): given to the
    # chat template as `reasoning_content`, which thinking models' templates read
    reasoning_content: str | None = None
    reasoning: str | None = None
    # what an assistant message the openai client returned holds beside its content, when sent back as it
    # dumps it (`message.model_dump()`): taken, not rendered
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    parsed: Any = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None  # taken either way: the arguments always follow the schema


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool | None = None
    # vLLM's extension: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema` (and the Responses API's `text.format` fields). `strict` is taken
    either way: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: plain text, any JSON object (JSON mode), or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self, param: str) -> StructuredOutputsParams | None:
        if self.type == "json_schema" and self.json_schema is None:
            raise bad_request(
                "a json_schema response format needs its json_schema", param=f"{param}.json_schema"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise bad_request(
                f"json_schema is only taken with type json_schema, not {self.type}", param=param
            )
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return _format_constraint(self.type, schema, param, f"{param}.json_schema.schema")


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, a choice of strings, or JSON mode."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    def structured(self, param: str) -> StructuredOutputsParams:
        given = self.model_dump(by_alias=True, exclude_none=True)
        if len(given) != 1:
            raise bad_request(
                "structured_outputs takes exactly one of json, regex, choice and json_object", param=param
            )
        (kind,) = given
        return _structured(f"{param}.{kind}", **given)


def _format_constraint(kind: str, schema, param: str, schema_param: str) -> StructuredOutputsParams | None:
    """What an OpenAI output format of this type asks: nothing (text), any JSON object, or `schema`."""
    if kind == "text":
        return None
    if kind == "json_object":
        return _structured(param, json_object=True)
    return _structured(schema_param, json=schema)


def _structured(param: str, **spec) -> StructuredOutputsParams:
    """StructuredOutputsParams(**spec), its ValueError (a schema it cannot honour) a 400 naming `param`."""
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as e:
        raise bad_request(str(e), param=param) from None


# vLLM's older constraint fields and what each one is of StructuredOutputsParams
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


class _SamplingFields(_Strict):
    """Sampling fields shared by chat and text completions (OpenAI names, then Kestrel/vLLM extensions)."""

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    n: Int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility; an opaque end-user id that the server does not use
    # extensions
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool | None = None  # the stop string, or stop token's text, kept at the end
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[Int] | None = None  # vLLM's: only these tokens are sampled
    logit_bias: dict[str, float] | None = None
    # the output constrained: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # OpenAI fields this server does not implement: refused unless given their neutral value
    service_tier: Any = None
    metadata: Any = None
    store: Any = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **extra) -> SamplingParams:
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "seed": self.seed,
            "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": _logit_bias(self.logit_bias, "logit_bias"),
            "allowed_token_ids": self.allowed_token_ids,
            "structured_outputs": self.structured(),
        }
        kwargs = {k: v for k, v in {**given, **extra}.items() if v is not None}
        return make_sampling_params(max_tokens=max_tokens, logprobs=logprobs, **kwargs)

    def structured(self) -> StructuredOutputsParams | None:
        """The output's constraint, from whichever one field gives it (400 where two do)."""
        if self.response_format is not None:
            self.response_format.structured("response_format")  # (its own checks, type text included)
        given = self._constraint_fields()
        if len(given) > 1:
            raise bad_request(f"give one of {' and '.join(given)}", param=given[1])
        if not given:
            return None
        name = given[0]
        if name == "tool_choice":
            return _structured("tools", json=tool_calls_schema(self))
        if name in _GUIDED:
            return _structured(name, **{_GUIDED[name]: getattr(self, name)})
        return getattr(self, name).structured(name)

    @property
    def constraint_field(self) -> str | None:
        """The field that constrains the output, as the request spells it (for the engine's errors)."""
        name = next(iter(self._constraint_fields()), None)
        if name == "response_format" and self.response_format.type == "json_schema":
            return "response_format.json_schema.schema"
        return "tools" if name == "tool_choice" else name

    def _constraint_fields(self) -> list[str]:
        """The fields given that constrain the output (a text response_format constrains nothing; tools do where
        `tool_choice` asks for calls)."""
        fields = ("response_format", "structured_outputs", *_GUIDED)
        given = [name for name in fields if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if getattr(self, "tool_calls_asked", None) is not None:
            given.insert(0, "tool_choice")
        return given

    def check_common(self) -> None:
        _refuse_unsupported(self, _NEUTRAL_COMMON)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.n is not None and self.n > MAX_N:
            raise bad_request(f"n must be <= {MAX_N}", param="n")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM: continuous_usage_stats, taken with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _check_template_kwargs(kwargs: dict | None) -> None:
    """chat_template_kwargs' flaws as 400s naming the key."""
    try:
        check_template_kwargs(kwargs)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from None


class _ChatTemplateFields(_Strict):
    """vLLM's chat-template options: `add_generation_prompt` (the assistant's turn opened; true unless given),
    `continue_final_message` (the last message left open for the model to go on with) and `chat_template_kwargs`
    (more variables for the template, such as `enable_thinking`). Given the second alone, the first is false: in
    vLLM its default stays true and the pair is refused; here only an explicit `add_generation_prompt: true` with
    it is."""

    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        _check_template_kwargs(self.chat_template_kwargs)

    def template_options(self) -> dict:
        """apply_chat_template's keyword arguments."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": bool(self.continue_final_message),
            "chat_template_kwargs": self.chat_template_kwargs,
        }


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """Tools (`kestrel.serve.tools`): `tool_choice` "required" or a named function makes the reply tool calls, its
    arguments held to each function's parameters schema by structured outputs (vLLM's way); "none" a reply in
    text, the tools shown to the chat template; "auto" (the default with tools) lets the model decide, in its own
    format, which the server's tool-call parser reads (refused where it has none)."""

    messages: list[ChatMessage]
    max_tokens: Int | None = None  # None: up to the context limit
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        self.check_common()
        _refuse_unsupported(self, _NEUTRAL_CHAT)
        self.check_template_options()
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        _check_contents(self.messages)
        check_tools(self)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise bad_request(
                "max_tokens and max_completion_tokens disagree; give one", param="max_completion_tokens"
            )

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self.sampling_params(max_tokens, logprobs)
        except _FieldError as e:
            raise e.as_request_error(
                {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_field}
            ) from None

    def template_options(self) -> dict:
        """apply_chat_template's keyword arguments: the tools too, for templates that show them."""
        return {**super().template_options(), "tools": _template_tools(self.tools)}

    @property
    def tool_calls_asked(self) -> list[str] | None:
        """The functions the reply calls ("required": any of the tools; named: that one), None for a reply in
        text."""
        return tool_calls_asked(self)

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def chat_messages(self) -> list[dict]:
        return _template_messages(self.messages)


def _check_contents(messages: list[ChatMessage]) -> None:
    """OpenAI's rules: only an assistant turn may come without content (a user turn's null was rendered empty)
    and make tool calls; a tool turn, and it alone, names the call it answers."""
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise bad_request("only an assistant message makes tool calls", param=f"messages.{i}.tool_calls")
        if (m.tool_call_id is None) == (m.role == "tool"):
            what = "a tool message needs" if m.role == "tool" else "only a tool message takes"
            raise bad_request(f"{what} tool_call_id", param=f"messages.{i}.tool_call_id")
        if m.content is None and m.role != "assistant":
            raise bad_request(
                f"a {m.role} message needs its content",
                param=f"messages.{i}.content",
                code="missing_parameter",
            )


def _template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (an assistant turn's `tool_calls` and a tool turn's
    `tool_call_id` with them, for templates that render tools)."""
    out = []
    for m in messages:
        message = _template_message(
            m.role, m.content if not isinstance(m.content, list) else [p.model_dump() for p in m.content]
        )
        if m.tool_calls:
            # the arguments as an object, as Hugging Face's templates render them (`arguments | tojson`)
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and m.role == "assistant":
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


def _template_tools(tools: list[ChatTool] | None) -> list[dict] | None:
    """The tools as dicts, for the chat template (the tokenizer gives a function without parameters an empty
    object's schema)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def _arguments(text: str):
    """An earlier call's arguments as the object their JSON text holds (empty text: {}), or the text as it is
    where it is not JSON: a call cut short, or a model's own call written wrong (tool_choice "auto"), goes back
    as the server returned it."""
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:
        return text


def _template_message(role: str, content) -> dict:
    """One message as the chat template takes it: OpenAI's "developer" is a system message."""
    return {"role": "system" if role == "developer" else role, "content": content}


class CompletionRequest(_SamplingFields):
    """`echo` with `logprobs` returns the prompt's logprobs before the completion's (the engine's
    prompt_logprobs; the first prompt token's are null), and `max_tokens` 0 with `echo` the prompt alone, as vLLM
    (what lm-evaluation-harness's loglikelihood requests send)."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16  # null: 16 as well
    logprobs: Int | None = None
    echo: bool | None = None
    best_of: Int | None = None
    suffix: Any = None

    def check(self) -> None:
        self.check_common()
        _refuse_unsupported(self, _NEUTRAL_COMPLETION)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request(
                "best_of other than n is not supported", param="best_of", code="unsupported_value"
            )

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: the prompt alone (the engine makes one token, which is not shown)."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = 1 if self.echo_only else 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo else None
        try:
            return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs)
        except _FieldError as e:
            raise e.as_request_error({}) from None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        return list(p)


class NativeSamplingParams(_Strict):
    """SGLang's sampling dict: `max_new_tokens`, `min_new_tokens`, and vLLM-style names for the rest."""

    max_new_tokens: Int | None = 128  # None: up to the context limit
    min_new_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    n: Int | None = None
    seed: Int | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int] | None = None
    # SGLang's constrained decoding: a JSON schema (its JSON text) or a regex
    json_schema: str | None = None
    regex: str | None = None


class GenerateRequest(_Strict):
    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: NativeSamplingParams | None = None
    # null is "not given" (false, 0), as in the OpenAI routes
    stream: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: Int | None = None

    def check(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of text and input_ids", param="text")
        if self.top_logprobs_num and not self.return_logprob:
            raise bad_request("top_logprobs_num needs return_logprob", param="top_logprobs_num")
        n = (self.sampling_params.n if self.sampling_params else None) or 1
        if n > MAX_N:
            raise bad_request(f"n must be <= {MAX_N}", param="sampling_params.n")

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            prompts = [self.text] if isinstance(self.text, str) else list(self.text)
        elif self.input_ids and all(isinstance(t, int) for t in self.input_ids):
            prompts = [list(self.input_ids)]
        else:
            prompts = list(self.input_ids or [])
        if not prompts:
            raise bad_request("no prompt given", param="text" if self.text is not None else "input_ids")
        return prompts

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))

    @property
    def constraint_field(self) -> str | None:
        sp = self.sampling_params
        given = [] if sp is None else [f for f in ("json_schema", "regex") if getattr(sp, f) is not None]
        return f"sampling_params.{given[0]}" if given else None

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params or NativeSamplingParams()
        given = sp.model_dump(
            exclude={"max_new_tokens", "min_new_tokens", "json_schema", "regex"}, exclude_none=True
        )
        if sp.json_schema is not None and sp.regex is not None:
            raise bad_request("give one of json_schema and regex", param="sampling_params.regex")
        if sp.json_schema is not None:
            given["structured_outputs"] = _structured("sampling_params.json_schema", json=sp.json_schema)
        if sp.regex is not None:
            given["structured_outputs"] = _structured("sampling_params.regex", regex=sp.regex)
        if sp.logit_bias is not None:
            given["logit_bias"] = _logit_bias(sp.logit_bias, "sampling_params.logit_bias")
        if sp.min_new_tokens is not None:
            given["min_tokens"] = sp.min_new_tokens
        logprobs = (self.top_logprobs_num or 0) if self.return_logprob else None
        try:
            return make_sampling_params(max_tokens=sp.max_new_tokens, logprobs=logprobs, **given)
        except _FieldError as e:
            native = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}.get(e.param, e.param)
            param = "top_logprobs_num" if e.param == "logprobs" else f"sampling_params.{native}"
            raise e.as_request_error({e.param: param}) from None


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a `prompt` as /v1/completions reads it, or chat `messages` as /v1/chat/completions
    renders them (with the assistant's opening unless `add_generation_prompt` is false or
    `continue_final_message` true)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # shown to the chat template, as the chat route shows them

    def check(self) -> None:
        self.check_template_options()
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give one of prompt and messages", param="prompt")
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"):
            if self.prompt is not None and getattr(self, name) is not None:
                raise bad_request(f"{name} applies to messages, not to a prompt", param=name)
        if self.messages is not None and not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.messages is not None:
            _check_contents(self.messages)

    def chat_messages(self) -> list[dict]:
        return _template_messages(self.messages)

    def template_options(self) -> dict:
        return {**super().template_options(), "tools": _template_tools(self.tools)}


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text (special tokens kept, so what is shown is what was sent)."""

    model: str | None = None
    tokens: list[Int]


def parse(model: type[BaseModel], body: bytes):
    """The request body as `model`, checked; APIError (400) naming the first bad field otherwise."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    request.check()
    return request


class _FieldError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)
        self.param = message.split(" ", 1)[0]

    def as_request_error(self, renamed: dict[str, str]):
        """The 400 for this field, named (param and message) as the request spells it: `renamed` maps
        SamplingParams' field names to the request's."""
        param = renamed.get(self.param, self.param)
        return bad_request(param + str(self)[len(self.param) :], param=param)


def make_sampling_params(**kwargs) -> SamplingParams:
    """SamplingParams, with its ValueError (which starts with the field name) as a _FieldError."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise _FieldError(str(e)) from None


# Unsupported fields and the values that ask for nothing (so they may be sent).
_NEUTRAL_COMMON: dict[str, tuple] = {
    "service_tier": (None, "auto", "default"),
    "metadata": (None,),
    "store": (None, False),
}
_NEUTRAL_CHAT: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
_NEUTRAL_COMPLETION: dict[str, tuple] = {"suffix": (None, "")}


def _refuse_unsupported(request: BaseModel, neutral: dict[str, tuple]) -> None:
    for name, allowed in neutral.items():
        value = getattr(request, name)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise bad_request(
                f"{name} is not supported by this server", param=name, code="unsupported_parameter"
            )
