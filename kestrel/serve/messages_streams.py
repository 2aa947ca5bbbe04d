"""Anthropic's Messages API replies: the message (its content blocks, stop_reason, usage) and its event stream
(`message_start`, each block's `content_block_start` / `_delta` / `_stop`, `message_delta` with the stop reason and
the usage, `message_stop`; an `error` event where the engine fails). A reply is read into blocks as the chat route
reads it into content and tool_calls: by its parsers where the model decides (its thinking a `thinking` block, its
prose `text` blocks, each call a `tool_use` block, in the order written), by the tool calls' JSON where they are
asked for (tool_choice any / tool), as text otherwise. Usage as Anthropic counts it: `input_tokens` the prompt's
tokens the prefix cache did not give, `cache_read_input_tokens` those it did."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic_core import from_json

from kestrel.serve.choice import ChoiceState
from kestrel.serve.jobs import Job, Server
from kestrel.serve.messages_protocol import MessagesRequest, anthropic_id
from kestrel.serve.reply import Parsers, Reasoning, ReplyReader
from kestrel.serve.streams import failure
from kestrel.serve.tool_parsers import CallArguments, CallBegun, CallEnded, Prose, call_id
from kestrel.serve.tools import finish_reason as tool_finish_reason
from kestrel.serve.tools import read_tool_calls


class _Blocks:
    """A reply's content blocks as they are read: `text` (more of a text or thinking block: a new one where the
    kind changes, the block before it closed), `call` (a tool_use block begun) and its `arguments`, `close` the
    open block. `take` gives the stream's events (kind, data) since last taken; `content` holds the blocks, each
    call's input its JSON read at its close (`_input`)."""

    def __init__(self):
        self.content: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self.calls = 0
        self._open: int | None = None  # the block being written
        self._arguments: dict[int, str] = {}  # a tool_use block's index -> its input's text so far

    def text(self, kind: str, text: str) -> None:
        """More of a `text` or `thinking` block (a new one where the open block is another)."""
        if not text:
            return
        if self._open is None or self.content[self._open]["type"] != kind:
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": ""}
            if kind == "thinking":
                block["signature"] = ""  # (none is made here)
            self._start(block)
        self.content[self._open][kind] += text
        delta = (
            {"type": "text_delta", "text": text}
            if kind == "text"
            else {"type": "thinking_delta", "thinking": text}
        )
        self.events.append(("content_block_delta", {"index": self._open, "delta": delta}))

    def call(self, id_: str, name: str) -> int:
        """A `tool_use` block begun; its index."""
        self.calls += 1
        self._start({"type": "tool_use", "id": id_, "name": name, "input": {}})
        self._arguments[self._open] = ""
        return self._open

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        self._arguments[index] += text
        delta = {"type": "input_json_delta", "partial_json": text}
        self.events.append(("content_block_delta", {"index": index, "delta": delta}))

    def close(self) -> None:
        """The open block closed (a call's input parsed)."""
        if self._open is None:
            return
        index, self._open = self._open, None
        if index in self._arguments:
            self.content[index]["input"] = _input(self._arguments[index])
        self.events.append(("content_block_stop", {"index": index}))

    def take(self) -> list[tuple[str, dict]]:
        out, self.events = self.events, []
        return out

    def _start(self, block: dict) -> None:
        self.close()
        self._open = len(self.content)
        self.content.append(block)
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        self.events.append(("content_block_start", {"index": self._open, "content_block": start}))


def _input(text: str) -> dict:
    """A call's input: the object its JSON text holds, so far where the reply's end cut it (as the SDK reads a
    stream's partial JSON: a string cut short left out); {} where the text is not an object's (the SDK's stream
    refuses such a call's deltas: Anthropic's `input` is always an object)."""
    try:
        value = from_json(text, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _Reader:
    """One reply read into `_Blocks` piece by piece, in the way the request asks: its parsers' events, a named
    call's input as it comes, "any" calls once their JSON has ended, or text."""

    def __init__(self, req: MessagesRequest, parsers: Parsers | None):
        self.req, self.blocks = req, _Blocks()
        asked = req.tool_calls_asked
        self._named = asked is not None and req.tool_view.tool_choice != "required"
        self._any = asked is not None and not self._named
        self._reader = ReplyReader(parsers) if parsers else None
        self._calls: dict[int, int] = {}  # a parsed call's index -> its block's
        if self._named:
            self._named_block = self.blocks.call(call_id(), asked[0])

    def read(self, piece: str, choice: ChoiceState) -> None:
        b = self.blocks
        if self._named:
            b.arguments(self._named_block, piece)
        elif self._any:
            if choice.finished:
                # (cut before its JSON ended: the calls begun, as far as they came)
                for c in read_tool_calls(self.req.tool_view, choice.text, partial=True):
                    b.arguments(b.call(c["id"], c["function"]["name"]), c["function"]["arguments"])
        elif self._reader is not None:
            for e in self._reader.read(piece, choice.finished):
                if isinstance(e, Reasoning):
                    b.text("thinking", e.text)
                elif isinstance(e, Prose):
                    b.text("text", e.text)
                elif isinstance(e, CallBegun):
                    self._calls[e.index] = b.call(anthropic_id(e.id), e.name)
                elif isinstance(e, CallArguments):
                    b.arguments(self._calls[e.index], e.text)
                elif isinstance(e, CallEnded):
                    b.close()
        else:
            b.text("text", piece)
        if choice.finished:
            b.close()


def stop_reason(choice: ChoiceState, calls: int) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence: tool_use where the reply's calls ended it, max_tokens,
    stop_sequence (with the one matched), or end_turn."""
    if not choice.finished:
        return None, None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    if tool_finish_reason(choice.finish_reason, choice.stop_reason, [{}] * calls or None) == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def message_usage(job: Job) -> dict:
    usage = job.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _message(server: Server, job: Job, content: list, stop: tuple, usage: dict) -> dict:
    return {
        "id": f"msg_{job.id}",
        "type": "message",
        "role": "assistant",
        "model": server.model_name,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def message_body(server: Server, job: Job, req: MessagesRequest, parsers: Parsers | None) -> dict:
    """The whole reply as Anthropic's message, read as the stream reads it (one piece)."""
    choice = job.choices[0]
    reader = _Reader(req, parsers)
    reader.read(choice.text, choice)
    return _message(
        server, job, reader.blocks.content, stop_reason(choice, reader.blocks.calls), message_usage(job)
    )


async def message_stream(
    server: Server, job: Job, req: MessagesRequest, parsers: Parsers | None
) -> AsyncIterator[str]:
    """The reply as Anthropic's events (`event: <type>` and its JSON), each block as it is read. `message_start`
    comes with the first output, once the prompt's cached part is known (its usage counted as the last event's)."""

    def event(kind: str, data: dict) -> str:
        body = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {body}\n\n"

    def start() -> list[str]:
        usage = {**message_usage(job), "output_tokens": 0}
        message = _message(server, job, [], (None, None), usage)
        return [event("message_start", {"message": message}), event("ping", {})]

    try:
        reader, started = _Reader(req, parsers), False
        choice = job.choices[0]
        async for _, piece, _, choice in job.events():
            if not started:
                started = True
                for e in start():
                    yield e
            reader.read(piece, choice)
            for kind, data in reader.blocks.take():
                yield event(kind, data)
        if not started:  # (no output: the engine ended the reply before its first token)
            for e in start():
                yield e
        reader.blocks.close()  # (a block the last output left open)
        for kind, data in reader.blocks.take():
            yield event(kind, data)
        stop = stop_reason(choice, reader.blocks.calls)
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        yield event("message_delta", {"delta": delta, "usage": message_usage(job)})
        yield event("message_stop", {})
    except Exception as e:  # the stream ends with the error, not a cut connection
        yield event("error", {"error": {"type": "api_error", "message": failure(e)["message"]}})
