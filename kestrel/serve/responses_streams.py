"""The Responses API's bodies: the response object (its output items, status, usage and settings as they took
effect) and its typed event stream (`event: <type>` with a sequence number; no `[DONE]`), item by item where
parsers read the reply (`_ItemWalk`)."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator

from kestrel.serve.choice import ChoiceState
from kestrel.serve.jobs import Job, Server
from kestrel.serve.reply import Parsers, Reasoning, ReplyReader
from kestrel.serve.responses_protocol import ResponsesRequest
from kestrel.serve.streams import failure
from kestrel.serve.tool_parsers import CallArguments, CallBegun, CallEnded, Prose, call_id
from kestrel.serve.tools import read_tool_calls


def response_body(
    server: Server,
    job: Job,
    req: ResponsesRequest,
    created: int,
    done: bool = True,
    error: dict | None = None,
    parsers: Parsers | None = None,
    walk: _ItemWalk | None = None,
) -> dict:
    """A Responses API response object: its output (once `done`; empty before): one message, or where tools are
    called a `function_call` item a call (`response_output`); its status (`incomplete` with reason
    max_output_tokens where the reply ran out of tokens; `failed` with `error`) and usage; the request's settings
    as they took effect. `parsers`: those that read the reply (its reasoning, the model's own calls), whose
    items a stream has walked already (`walk`) or the whole reply is walked here, as a stream walks it (so that
    the two agree: order, statuses, the calls' ids)."""
    choice = job.choices[0]
    incomplete = done and choice.finish_reason == "length"
    status = "failed" if error else "in_progress" if not done else "incomplete" if incomplete else "completed"
    if done and not error and parsers and walk is None:
        walk = _ItemWalk(job, parsers)
        walk.read(choice.text, True, status)
        walk.close(status)
    params = job.params  # as they took effect (defaults filled in)
    body = {
        "id": f"resp_{job.id}",
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": server.model_name,
        "output": (walk.items if walk is not None else response_output(job, req, status))
        if done and not error
        else [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "tool_choice": _dumped(req.tool_choice) or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "text": {"format": req.text_format()},
        "metadata": req.metadata or {},
        "store": False,  # nothing is kept: the response cannot be fetched later
        "usage": None,
    }
    if done and not error:
        usage = job.usage()
        body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(choice, walk)},
            "total_tokens": usage["total_tokens"],
        }
    return body


def _reasoning_tokens(choice: ChoiceState, walk: _ItemWalk | None) -> int:
    """The reply's tokens that begin inside its reasoning (its closing marker's included)."""
    end = walk.reader.reasoning_end if walk is not None else 0
    return sum(1 for offset in choice.text_offsets if offset < end)


def _dumped(value):
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def response_output(
    job: Job,
    req: ResponsesRequest,
    status: str,
    call_ids: list[str] | None = None,
) -> list:
    """The response's output items where no parser reads the reply: its message, or its tool calls as
    `function_call` items (a "required" reply cut before its JSON ended stays a message: no call can be read from
    it). `call_ids`: the calls' ids where a stream already gave them."""
    text = job.choices[0].text
    calls = read_tool_calls(req.tool_view, text, call_ids) if req.tool_calls_asked is not None else None
    if calls is None:
        return [_response_message(job, status, text)]
    return [_function_call(c["id"], c["function"]["name"], c["function"]["arguments"], status) for c in calls]


def _reasoning_item(job: Job, status: str, text: str) -> dict:
    return {
        "type": "reasoning",
        "id": f"rs_{job.id}",
        "summary": [],
        "content": [_reasoning_text(text)],
        "status": status,
    }


def _function_call(call: str, name: str, arguments: str, status: str) -> dict:
    """A `function_call` output item (its id derived from the call's)."""
    return {
        "type": "function_call",
        # (a model's own call ids, as Kimi's `functions.NAME:IDX`, repeat across replies: the item's is made)
        "id": "fc_" + (call.removeprefix("call_") if call.startswith("call_") else uuid.uuid4().hex[:24]),
        "call_id": call,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _response_message(job: Job, status: str, text: str | None) -> dict:
    """The output message item; `text` None: its content not begun (the stream's first mention of it)."""
    content = [] if text is None else [_output_text(text)]
    return {
        "type": "message",
        "id": f"msg_{job.id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def responses_stream(
    server: Server, job: Job, req: ResponsesRequest, created: int, parsers: Parsers | None = None
) -> AsyncIterator[str]:
    """The Responses API's typed events (`event: <type>` and its JSON, each with a sequence number): the
    response created and in progress, its message item and text part added, the text's deltas, then each closed
    and the response completed (or incomplete); where the engine fails, an `error` event and the response
    failed. No `[DONE]`. Where the reply is tool calls: a named call's item is added first and its arguments
    stream as `function_call_arguments` deltas; "required" calls come once their JSON has ended, each item added,
    its arguments in one delta, and closed (a reply cut before that, a message). Where `parsers` read the reply,
    each item as it is read: the reasoning first, the message at its first prose, a call at its start, its
    arguments as they come; the message is closed at the end."""
    numbered = itertools.count()

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(numbered), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    calls_asked = req.tool_calls_asked
    named = calls_asked is not None and req.tool_choice != "required"
    try:
        yield event("response.created", response=response_body(server, job, req, created, done=False))
        yield event("response.in_progress", response=response_body(server, job, req, created, done=False))
        if named:
            call = call_id()
            item = _function_call(call, calls_asked[0], "", "in_progress")
            yield event("response.output_item.added", output_index=0, item=item)
            async for _, piece, _, _ in job.events():
                if piece:
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=0,
                        delta=piece,
                    )
            final = response_body(server, job, req, created)
            (done,) = final["output"] = response_output(job, req, final["status"], [call])
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=0,
                name=done["name"],
                arguments=done["arguments"],
            )
            yield event("response.output_item.done", output_index=0, item=done)
        elif parsers:
            walk = _ItemWalk(job, parsers)
            async for e in _parsed_events(event, job, walk):
                yield e
            final = response_body(server, job, req, created, parsers=parsers, walk=walk)
        elif calls_asked is not None:
            async for _ in job.events():
                pass  # (the calls are read once their JSON has ended)
            final = response_body(server, job, req, created)
            for k, out in enumerate(final["output"]):
                for e in _whole_item_events(event, k, out):
                    yield e
        else:
            async for e in _message_events(event, job):
                yield e
            final = response_body(server, job, req, created)
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
        yield event(f"response.{final['status']}", response=final)
    except Exception as e:  # the stream ends with the error and the response failed, not a cut connection
        error = failure(e)
        yield event("error", **error, param=None)
        yield event("response.failed", response=response_body(server, job, req, created, error=error))


async def _message_events(event, job: Job):
    """The message item added, its text part added, the text's deltas, the text and the part done."""
    item = {"item_id": f"msg_{job.id}", "output_index": 0}
    yield event(
        "response.output_item.added", output_index=0, item=_response_message(job, "in_progress", None)
    )
    yield event("response.content_part.added", **item, content_index=0, part=_output_text(""))
    async for _, piece, _, _ in job.events():
        if piece:
            yield event("response.output_text.delta", **item, content_index=0, delta=piece, logprobs=[])
    text = job.choices[0].text
    yield event("response.output_text.done", **item, content_index=0, text=text, logprobs=[])
    yield event("response.content_part.done", **item, content_index=0, part=_output_text(text))


class _ItemWalk:
    """A reply read by the parsers as Responses output items, in the order they begin: the reasoning (closed
    when the answer begins), the message at its first prose (which later prose goes on), each call (closed at
    its end); the message is closed last. `read` gives the events (kind, fields) of each piece; an item is
    "completed" unless the reply's end cut it (then the response's status)."""

    def __init__(self, job: Job, parsers: Parsers):
        self.job, self.items = job, []
        self.reader = ReplyReader(parsers)
        self._ids: dict[int, dict] = {}  # an item's index -> its content's ids
        self._calls: dict[int, int] = {}  # a call's index -> its item's
        self._message = self._reasoning = self._last = None  # item indices (_last: the last event's)

    def read(self, piece: str, finished: bool, status: str = "completed") -> list[tuple[str, dict]]:
        """The events of a piece of the reply; `status`: the response's, where the reply ended with it."""
        out = []
        for e in self.reader.read(piece, finished):
            if self._reasoning is not None and self._last == self._reasoning and not isinstance(e, Reasoning):
                out += self._close(self._reasoning, "completed")
            if isinstance(e, Reasoning):
                if self._reasoning is None:
                    self._reasoning = len(self.items)
                    out += self._open(_reasoning_item(self.job, "in_progress", ""), _reasoning_text(""))
                out += self._add(self._reasoning, "reasoning_text", e.text, {})
            elif isinstance(e, Prose):
                if self._message is None:
                    self._message = len(self.items)
                    out += self._open(_response_message(self.job, "in_progress", ""), _output_text(""))
                out += self._add(self._message, "output_text", e.text, {"logprobs": []})
            elif isinstance(e, CallBegun):
                self._last = self._calls[e.index] = len(self.items)
                self.items.append(_function_call(e.id, e.name, "", "in_progress"))
                out.append(
                    ("response.output_item.added", {"output_index": self._last, "item": dict(self.items[-1])})
                )
            elif isinstance(e, CallArguments):
                k = self._calls[e.index]
                self.items[k]["arguments"] += e.text
                ids = {"item_id": self.items[k]["id"], "output_index": k}
                out.append(("response.function_call_arguments.delta", {**ids, "delta": e.text}))
            elif isinstance(e, CallEnded):
                k = self._calls[e.index]
                item = self.items[k]
                item["status"] = status if e.cut else "completed"
                ids = {"item_id": item["id"], "output_index": k}
                done = {**ids, "name": item["name"], "arguments": item["arguments"]}
                out.append(("response.function_call_arguments.done", done))
                out.append(("response.output_item.done", {"output_index": k, "item": dict(item)}))
        return out

    def close(self, status: str) -> list[tuple[str, dict]]:
        """The events that end the walk: an item still open closed (cut where the reply's end is its: `status`),
        an empty reply an empty message, as the whole response has it."""
        if not self.items:
            self._message = 0
            out = self._open(_response_message(self.job, "in_progress", ""), _output_text(""))
            return out + self._close(0, status)
        out = []
        for k in (self._reasoning, self._message):
            if k is not None and self.items[k]["status"] == "in_progress":
                out += self._close(k, status if k == self._last else "completed")
        return out

    def _open(self, item: dict, part: dict) -> list[tuple[str, dict]]:
        self._last = index = len(self.items)
        self.items.append(item)
        self._ids[index] = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            ("response.output_item.added", {"output_index": index, "item": {**item, "content": []}}),
            ("response.content_part.added", {**self._ids[index], "part": part}),
        ]

    def _add(self, index: int, kind: str, text: str, extra: dict) -> list[tuple[str, dict]]:
        self._last = index
        self.items[index]["content"][0]["text"] += text
        return [(f"response.{kind}.delta", {**self._ids[index], "delta": text, **extra})]

    def _close(self, index: int, status: str) -> list[tuple[str, dict]]:
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        kind, extra = part["type"], ({"logprobs": []} if part["type"] == "output_text" else {})
        return [
            (f"response.{kind}.done", {**self._ids[index], "text": part["text"], **extra}),
            ("response.content_part.done", {**self._ids[index], "part": dict(part)}),
            ("response.output_item.done", {"output_index": index, "item": {**item, "content": [dict(part)]}}),
        ]


async def _parsed_events(event, job: Job, walk: _ItemWalk):
    """A reply read by the parsers as the Responses API's events, item by item (`_ItemWalk`)."""
    status = "completed"
    async for _, piece, _, choice in job.events():
        if choice.finished:
            status = "incomplete" if choice.finish_reason == "length" else "completed"
        for kind, fields in walk.read(piece, choice.finished, status):
            yield event(kind, **fields)
    for kind, fields in walk.close(status):
        yield event(kind, **fields)


def _reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _whole_item_events(event, index: int, out: dict) -> list[str]:
    """An output item that is known whole: added, its content in one delta, done."""
    start = {**out, "status": "in_progress"}
    if out["type"] == "function_call":
        ids = {"item_id": out["id"], "output_index": index}
        return [
            event("response.output_item.added", output_index=index, item={**start, "arguments": ""}),
            event("response.function_call_arguments.delta", **ids, delta=out["arguments"]),
            event(
                "response.function_call_arguments.done", **ids, name=out["name"], arguments=out["arguments"]
            ),
            event("response.output_item.done", output_index=index, item=out),
        ]
    text = out["content"][0]["text"]
    ids = {"item_id": out["id"], "output_index": index, "content_index": 0}
    return [
        event("response.output_item.added", output_index=index, item={**start, "content": []}),
        event("response.content_part.added", **ids, part=_output_text("")),
        event("response.output_text.delta", **ids, delta=text, logprobs=[]),
        event("response.output_text.done", **ids, text=text, logprobs=[]),
        event("response.content_part.done", **ids, part=_output_text(text)),
        event("response.output_item.done", output_index=index, item=out),
    ]
