"""The response bodies of the HTTP layer: the OpenAI chat and completion streams (SSE chunks, `data: [DONE]` at
the end, an error event instead of a cut connection), the native /generate result and stream, and the shared head
of every OpenAI body. The Responses API's body and events: `responses_streams`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from kestrel.engine.async_engine import EngineDead
from kestrel.serve.choice import ChoiceState, chat_logprobs, completion_logprobs, echo_logprobs
from kestrel.serve.errors import error_body
from kestrel.serve.jobs import Job, Server
from kestrel.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from kestrel.serve.reply import Parsers, Reasoning, ReplyEvent, ReplyReader
from kestrel.serve.tool_parsers import CallArguments, CallBegun, Prose, call_id
from kestrel.serve.tools import finish_reason as tool_finish_reason
from kestrel.serve.tools import read_tool_calls

log = logging.getLogger("kestrel.serve")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def body_head(server: Server, job: Job, prefix: str, kind: str) -> dict:
    """The fields every OpenAI body and chunk starts with: id, object, created, model."""
    return {
        "id": f"{prefix}-{job.id}",
        "object": kind,
        "created": int(time.time()),
        "model": server.model_name,
    }


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    """A server-sent-events response of `events` (each already `data: ...\n\n`), unbuffered by proxies."""
    return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)


def _event(data: dict | str) -> str:
    if isinstance(data, str):
        return f"data: {data}\n\n"
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """End a stream with an error event (then [DONE]) instead of cutting the connection."""
    try:
        async for e in events:
            yield e
    except Exception as e:
        reason = failure(e)
        yield _event(error_body(reason["message"], "server_error", code=reason["code"]))
        yield _event("[DONE]")


def failure(e: Exception) -> dict:
    """What a stream that failed with `e` tells the client (`code`, `message`): the engine's death as it is,
    anything else as an internal error (logged). Call it where `e` is being handled."""
    if isinstance(e, EngineDead):
        return {"code": "engine_unavailable", "message": str(e)}
    log.exception("error while streaming a response")
    return {"code": "internal_error", "message": "internal server error"}


async def chat_stream(
    server: Server, job: Job, req: ChatCompletionRequest, parsers: Parsers | None = None
) -> AsyncIterator[str]:
    """OpenAI's chunks. Where the reply is tool calls (`kestrel.serve.tools`): a named call's arguments stream as
    `tool_calls` deltas after a first one with its id and name; "required" calls come whole in the choice's last
    chunk (their JSON read once it has ended). Where `parsers` read the reply, its reasoning streams as
    `reasoning_content` (and `reasoning`), then its prose as content and each of the model's own calls
    (tool_choice "auto") as it is read: its id and name, then its arguments."""
    head = body_head(server, job, "chatcmpl", "chat.completion.chunk")
    calls_asked = req.tool_calls_asked
    named = calls_asked is not None and req.tool_choice != "required"
    ids = [call_id() for _ in job.choices]
    readers = [ReplyReader(parsers) for _ in job.choices] if parsers else None

    async def events():
        for i in range(len(job.choices)):
            delta = {"role": "assistant", "content": "" if calls_asked is None else None}
            if named:
                call = {
                    "id": ids[i],
                    "type": "function",
                    "function": {"name": calls_asked[0], "arguments": ""},
                }
                delta["tool_calls"] = [{"index": 0, **call}]
            yield _event({**head, "choices": [_chunk_choice(i, delta, None)], **_chunk_usage(job, req)})
        async for index, piece, out, choice in job.events():
            logprobs = None
            if req.logprobs and out.new_logprobs:
                logprobs = {"content": chat_logprobs(server.tokenizer, out.new_logprobs)}
            if not (piece or logprobs or choice.finished):
                continue  # text held back (a partial character or a possible stop string)
            delta, reasons, calls = ({"content": piece} if piece else {}), _reasons(choice), None
            if calls_asked is not None:
                delta, calls = _tool_call_delta(req, piece, choice, ids[index], named)
            elif readers is not None:
                delta = _read_delta(readers[index].read(piece, choice.finished))
                calls = [{}] if readers[index].called else None
            if calls_asked is not None or readers is not None:
                if not (delta or logprobs or choice.finished):
                    continue  # ("required" calls are held until their JSON has ended; a marker until read)
                if choice.finished:
                    reasons["finish_reason"] = tool_finish_reason(
                        choice.finish_reason, choice.stop_reason, calls
                    )
                    if delta:  # the calls in a chunk of their own, then the finish, as OpenAI's stream
                        unfinished = {"finish_reason": None, "stop_reason": None}
                        body = {"index": index, "delta": delta, "logprobs": logprobs, **unfinished}
                        yield _event({**head, "choices": [body], **_chunk_usage(job, req)})
                        delta, logprobs = {}, None
            choices = [{"index": index, "delta": delta, "logprobs": logprobs, **reasons}]
            yield _event({**head, "choices": choices, **_chunk_usage(job, req)})
        if req.include_usage:
            yield _event({**head, "choices": [], "usage": job.usage()})
        yield _event("[DONE]")

    async for e in _stream_errors(events()):
        yield e


def _read_delta(read: list[ReplyEvent]) -> dict:
    """A chunk's delta from what the parsers read of its piece: reasoning, prose as content, each call begun with
    its id and name, arguments as they come (one entry a call)."""
    reasoning, content, calls = "", "", {}
    for e in read:
        if isinstance(e, Reasoning):
            reasoning += e.text
        elif isinstance(e, Prose):
            content += e.text
        elif isinstance(e, CallBegun):
            calls[e.index] = {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name}}
            calls[e.index]["function"]["arguments"] = ""
        elif isinstance(e, CallArguments):
            entry = calls.setdefault(e.index, {"index": e.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    delta = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


def _tool_call_delta(
    req, piece: str, choice: ChoiceState, call: str, named: bool
) -> tuple[dict, list | None]:
    """A chunk's delta where the reply is tool calls, and the calls read (None: not, or not yet)."""
    if named:
        calls = [{}] if choice.finished else None  # (a named reply is its call, whatever it holds)
        return ({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}), calls
    if not choice.finished:
        return {}, None
    calls = read_tool_calls(req, choice.text, [call])
    if calls is None:
        return {"content": choice.text}, None
    return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, calls


def _chunk_usage(job: Job, req: ChatCompletionRequest | CompletionRequest) -> dict:
    """A content chunk's usage field: absent without include_usage, the usage so far with
    continuous_usage_stats, else null (the last chunk, with no choices, carries the total)."""
    if not req.include_usage:
        return {}
    return {"usage": job.usage() if req.continuous_usage else None}


def _chunk_choice(index: int, delta: dict, logprobs, choice: ChoiceState | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, **_reasons(choice)}


def _reasons(choice: ChoiceState | None) -> dict:
    """A chunk's finish_reason and stop_reason (the stop string or token id that ended it, as in the whole
    response): null until the choice's last chunk."""
    if choice is None or not choice.finished:
        return {"finish_reason": None, "stop_reason": None}
    return {"finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


async def completion_stream(server: Server, job: Job, req: CompletionRequest) -> AsyncIterator[str]:
    head = body_head(server, job, "cmpl", "text_completion")

    def chunk(index, text, logprobs, choice=None):
        body = {"index": index, "text": text, "logprobs": logprobs, **_reasons(choice)}
        return _event({**head, "choices": [body], **_chunk_usage(job, req)})

    async def events():
        # the echoed prompts first; with logprobs, each once the engine has computed its logprobs (its first output)
        echoes = {i: choice.text for i, choice in enumerate(job.choices)} if req.echo else {}
        if req.logprobs is None:
            for i, text in echoes.items():
                if text:
                    yield chunk(i, text, None)
            echoes = {}
        async for index, piece, out, choice in job.events():
            if index in echoes:
                yield chunk(index, echoes.pop(index), echo_logprobs(server.tokenizer, choice))
            logprobs = None
            if req.logprobs is not None and out.new_logprobs and not choice.echo_only:
                n = len(out.new_logprobs)
                logprobs = completion_logprobs(server.tokenizer, out.new_logprobs, choice.text_offsets[-n:])
            if not (piece or logprobs or choice.finished):
                continue
            yield chunk(index, piece, logprobs, choice)
        if req.include_usage:
            yield _event({**head, "choices": [], "usage": job.usage()})
        yield _event("[DONE]")

    async for e in _stream_errors(events()):
        yield e


def native_finish_reason(c: ChoiceState) -> dict | None:
    """SGLang's `meta_info.finish_reason`: the length reached, or what matched: the stop string or token id, EOS's
    id too (the OpenAI routes' `stop_reason` is null for EOS, as vLLM has it; SGLang names the token)."""
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason is None:
        return None
    matched = c.stop_reason
    if matched is None and c.finish_reason == "stop" and c.token_ids:
        matched = c.token_ids[-1]  # EOS: the token ids end with the token that stopped them
    return {"type": c.finish_reason, "matched": matched}


def native_result(server: Server, job: Job, index: int, req: GenerateRequest) -> dict:
    c = job.choices[index]
    meta = {
        "id": job.group.request_ids[index],
        "finish_reason": native_finish_reason(c),
        "prompt_tokens": job.prompt_len(index),
        "completion_tokens": len(c.token_ids),
        "cached_tokens": c.num_cached_tokens,  # SGLang's: prompt tokens the prefix cache gave
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in c.logprobs]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [[[v, t] for t, v in lp.top] for lp in c.logprobs]
    return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}


async def generate_stream(server: Server, job: Job, req: GenerateRequest) -> AsyncIterator[str]:
    async def events():
        async for index, piece, out, choice in job.events():
            if piece or out.new_token_ids or choice.finished:
                yield _event({**native_result(server, job, index, req), "index": index})
        yield _event("[DONE]")

    async for e in _stream_errors(events()):
        yield e
