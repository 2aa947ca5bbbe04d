"""Chat templates: OpenAI-style messages and tools as a Jinja template (Hugging Face's) takes them, the template
compiled in a sandbox and rendered, a conversation's last message continued, `--chat-template` read and checked.
The tokenizers (`kestrel.tokenizer`) render through these."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from kestrel.utils.errors import ChatTemplateError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from kestrel.tokenizer import Tokenizer


def template_tools(tools: list | None) -> list | None:
    """The tools as a template takes them: none for an empty list, a function without parameters given an empty
    object's schema (templates read `parameters`)."""
    if not tools:
        return None
    out = []
    for t in tools:
        function = t.get("function") if isinstance(t, dict) else None
        if isinstance(function, dict) and "parameters" not in function:
            t = {**t, "function": {**function, "parameters": {"type": "object", "properties": {}}}}
        out.append(t)
    return out


TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")


def check_template_kwargs(kwargs: dict | None) -> None:
    """ValueError (naming the key) for chat_template_kwargs that are not a dict of names the template is free to
    take: those given by the renderer itself are refused."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be an object of template variables")
    for key in kwargs:
        if key in TEMPLATE_NAMES:
            raise ValueError(f"chat_template_kwargs.{key} cannot be given: the server sets {key!r} itself")


def normalize_message(message: dict) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"each message must be a dict with a string 'role', got {message!r}")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"unsupported message content part type {kind!r}; only 'text' is supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"a 'text' content part needs a string 'text', got {part!r}")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    return {**message, "content": content}


def render_template(
    template,
    messages: list[dict],
    add_generation_prompt: bool,
    specials: dict,
    tools: list | None = None,
    template_kwargs: dict | None = None,
) -> str:
    from jinja2 import TemplateError

    try:
        # (one dict: a key such as `self` would clash with render's own arguments)
        variables = {**(template_kwargs or {}), "messages": messages, "tools": tools, **specials}
        return template.render({**variables, "add_generation_prompt": add_generation_prompt})
    # (TypeError, ValueError: a filter given what it cannot take, such as tojson of an undefined value)
    except (TemplateError, TypeError, ValueError) as e:
        raise ChatTemplateError(f"chat template error: {e}") from None


def read_chat_template(value: str) -> str:
    """A --chat-template value: the text of the file it names, or (holding a `{`) the template itself, as vLLM's
    takes it."""
    if "{" in value and not os.path.isfile(value):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"chat template {value!r}: not a readable file ({e}) nor a template (no '{{')"
        ) from None


def pick_template(config: dict, path: str) -> str | None:
    """The chat template of a tokenizer folder `path` (its tokenizer_config.json read as `config`): the string, the
    list's "default", or chat_template.jinja beside it; None where it has none."""
    template = config.get("chat_template")
    if isinstance(template, list):
        if not all(isinstance(t, dict) for t in template):
            raise CheckpointError(f"{path}: chat_template: expected a string or a list of {{name, template}}")
        named = {t.get("name"): t.get("template") for t in template}
        if "default" not in named:
            raise CheckpointError(f"{path}: no chat template named 'default' among {sorted(map(str, named))}")
        template = named["default"]
    elif template is None and os.path.isfile(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read()
    if template is not None and not isinstance(template, str):  # (jinja's "Can't compile non template nodes")
        raise CheckpointError(f"{path}: chat_template: expected a string, got {type(template).__name__}")
    return template


def compile_template(source: str | None, path: str):
    """`source` compiled in Jinja's sandbox, as Hugging Face renders templates (`raise_exception`, a `tojson` that
    escapes no HTML); `path` names it in errors."""
    if source is None:
        return None
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None):  # jinja's own tojson escapes HTML, which a prompt must not
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise CheckpointError(f"{path}: chat template does not compile: {e}") from None


def continue_final(render: Callable[[list[dict]], str], messages: list[dict]) -> str:
    """The text of `messages` (normalized) with the last message's content left open, for the model to go on with
    it (vLLM's `continue_final_message`); `render` renders a conversation without the generation prompt."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    # the template renders a mark in the final message's place (private-use characters and a nonce, which
    # no template adds or changes and no message holds); the text is cut where it stands, and must be how
    # the template renders the whole conversation up to the end of the final content
    mark = f"\ue000{secrets.token_hex(8)}\ue001"
    text = render([*messages[:-1], {**messages[-1], "content": mark}])
    content = messages[-1]["content"]
    opened = text[: text.index(mark)] + content if text.count(mark) == 1 else None
    if opened is None or not render(messages).startswith(opened):
        raise ChatTemplateError(
            "the chat template does not render the final message's content as given, so it cannot be continued"
        )
    return opened


def use_chat_template(tokenizer: Tokenizer, value: str) -> None:
    """Give `tokenizer` the chat template of a --chat-template value (`read_chat_template`), checked on a
    one-turn chat now, so that a template that cannot render fails at start, not on the first request."""
    tokenizer.set_chat_template(read_chat_template(value), "--chat-template")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ConfigError(f"--chat-template does not render a one-turn chat: {e}") from None
