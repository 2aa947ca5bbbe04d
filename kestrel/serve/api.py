"""The HTTP server: `build_app(async_engine, served_model_name, api_key)` returns a FastAPI app.

Endpoints
- POST /v1/chat/completions, POST /v1/completions: OpenAI-compatible, streaming (SSE, ending `data: [DONE]`)
  or not; `n` choices, `stop`, `seed`, `logprobs`, `usage` (in a stream: a last chunk with `choices: []`
  when `stream_options.include_usage`).
- POST /generate: native, SGLang-style (`text` or `input_ids`, a `sampling_params` dict with
  `max_new_tokens`); a stream sends each choice's whole text so far in every event (SGLang's default).
- GET /v1/models, GET /health (503 once the engine thread has failed), GET /get_server_info (engine config,
  memory plan, pool and prefix-cache stats), GET /metrics (Prometheus text).
- POST /flush_cache: drop every cached prefix no running request uses, in every tier (GPU, host, disk); answers
  what was freed.

With an API key, every endpoint but /health and /metrics needs `Authorization: Bearer <key>` (401 otherwise):
load balancers and Prometheus scrape those two without credentials, and neither reveals request data.
Error statuses are described in `kestrel.serve.errors`. Detokenization and stop-string truncation run here,
on the event loop, so the engine thread only steps the model. A client that disconnects (mid-stream, or while
waiting for a non-streamed answer) has its requests aborted, which frees their KV pages and state slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kestrel.engine.async_engine import AsyncEngine, EngineDead, Overloaded, RequestGroup
from kestrel.engine.engine import RequestError
from kestrel.engine.outputs import StepOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.serve.choice import ChoiceState, chat_logprobs, completion_logprobs
from kestrel.serve.errors import APIError, bad_request, error_body
from kestrel.serve.metrics import CONTENT_TYPE, ServerMetrics
from kestrel.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    child_params,
    parse,
)
from kestrel.utils.errors import KestrelError
from kestrel.version import KESTREL_VERSION

log = logging.getLogger("kestrel.serve")
RETRY_AFTER_S = 1
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Job:
    """The engine requests behind one HTTP request: prompts x n choices, choice index = prompt * n + sample."""

    def __init__(
        self,
        server: Server,
        prompts: list[list[int]],
        params: SamplingParams,
        prefixes: list[str] | None = None,
        field_names: dict[str, str] | None = None,
    ):
        """`field_names`: the request's names for the engine's `prompt` and `max_tokens`, for error bodies."""
        children = child_params(params)
        self.server, self.prompts = server, prompts
        self.id = uuid.uuid4().hex
        items = [(prompt, child) for prompt in prompts for child in children]
        self.group: RequestGroup = server.submit(items, self.id, field_names or {})
        prefixes = prefixes or [""] * len(prompts)
        self.choices = [
            ChoiceState(server.tokenizer, prompt, child, prefix)
            for prompt, prefix in zip(prompts, prefixes)
            for child in children
        ]
        self._prompt_of = [i for i in range(len(prompts)) for _ in children]

    async def events(self) -> AsyncIterator[tuple[int, str, StepOutput, ChoiceState]]:
        """(choice index, new text, the engine output, the choice) for each output, until all finish."""
        metrics, arrival = self.server.metrics, self.group.arrival_time
        try:
            async for index, out in self.group:
                choice = self.choices[index]
                if choice.finished:
                    continue
                first, last = choice.first_token_time, choice.last_token_time
                piece = choice.update(out)
                metrics.on_tokens(arrival, first, last, len(out.new_token_ids))
                if choice.finished:
                    metrics.on_finished(arrival, out.num_prompt_tokens, choice.finish_reason)
                    if not out.finished:  # a stop string found here first
                        self.group.abort(index)
                yield index, piece, out, choice
        except EngineDead:
            self._count_unfinished("error")
            raise
        finally:
            self._count_unfinished("abort")  # the client went away
            self.group.close()

    def _count_unfinished(self, reason: str) -> None:
        for index, choice in enumerate(self.choices):
            if not choice.finished:
                choice.finished, choice.finish_reason = True, reason
                self.server.metrics.on_finished(self.group.arrival_time, self.prompt_len(index), reason)

    async def drain(self) -> None:
        async for _ in self.events():
            pass

    def prompt_len(self, index: int) -> int:
        return len(self.prompts[self._prompt_of[index]])

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Server:
    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None):
        self.engine, self.model_name, self.api_key = engine, served_model_name, api_key
        self.tokenizer = engine.engine.tokenizer
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None

    def submit(self, items, request_id: str, field_names: dict[str, str]) -> RequestGroup:
        try:
            return self.engine.submit(items, request_id)
        except RequestError as e:
            raise bad_request(str(e), param=field_names.get(e.param, e.param), code=e.code) from None
        except Overloaded as e:
            raise APIError(
                503, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except EngineDead as e:
            raise APIError(503, str(e), code="engine_unavailable") from None

    async def check_key(self, request: Request) -> None:  # async: FastAPI runs sync dependencies in threads
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    server = Server(async_engine, served_model_name, api_key)
    app = FastAPI(title="Kestrel", version=KESTREL_VERSION)
    app.state.server = server
    auth = [Depends(server.check_key)]
    _add_error_handlers(app)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await request.body())
        server.check_model(req.model)
        params = req.to_sampling_params()
        try:
            text = server.tokenizer.apply_chat_template(req.chat_messages(), add_generation_prompt=True)
        except (ValueError, KestrelError) as e:
            raise bad_request(str(e), param="messages") from None
        names = {"prompt": "messages", "max_tokens": req.max_tokens_field}
        job = Job(server, [server.encode(text, "messages")], params, field_names=names)
        if req.stream:
            return _sse(_chat_stream(server, job, req))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": chat_logprobs(server.tokenizer, c.logprobs)}
                if req.logprobs
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(job.choices)
        ]
        return JSONResponse(
            {**_head(server, job, "chatcmpl", "chat.completion"), "choices": choices, "usage": job.usage()}
        )

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        server.check_model(req.model)
        params = req.to_sampling_params()
        prompts = [server.encode(p, "prompt") if isinstance(p, str) else p for p in req.prompts()]
        prefixes = None
        if req.echo:
            prefixes = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in req.prompts()]
        job = Job(server, prompts, params, prefixes)
        if req.stream:
            return _sse(_completion_stream(server, job, req))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": None
                if req.logprobs is None
                else completion_logprobs(server.tokenizer, c.logprobs, c.text_offsets),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(job.choices)
        ]
        return JSONResponse(
            {**_head(server, job, "cmpl", "text_completion"), "choices": choices, "usage": job.usage()}
        )

    @app.post("/generate", dependencies=auth)
    async def generate(request: Request):
        req = parse(GenerateRequest, await request.body())
        params = req.to_sampling_params()
        param = "text" if req.text is not None else "input_ids"
        prompts = [server.encode(p, param) if isinstance(p, str) else p for p in req.prompts()]
        names = {"prompt": param, "max_tokens": "sampling_params.max_new_tokens", "n": "sampling_params.n"}
        job = Job(server, prompts, params, field_names=names)
        if req.stream:
            return _sse(_generate_stream(server, job, req))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        results = [_native_result(server, job, i, req) for i in range(len(job.choices))]
        return JSONResponse(results if req.batched or params.n > 1 else results[0])

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {
            "id": server.model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "kestrel",
            "root": async_engine.engine.config.model,
            "max_model_len": async_engine.engine.plan.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not async_engine.healthy:
            body = error_body(
                "the engine has failed; see the server log", "server_error", code="engine_unavailable"
            )
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/get_server_info", dependencies=auth)
    async def server_info():
        engine = async_engine.engine
        mc = engine.model.config
        return {
            "version": KESTREL_VERSION,
            "served_model_name": server.model_name,
            "healthy": async_engine.healthy,
            "device": str(engine.device),
            "dtype": str(engine.model.lm_head.weight.dtype).removeprefix("torch."),
            "engine_config": dataclasses.asdict(engine.config),
            "memory_plan": dataclasses.asdict(engine.plan),
            "model": {
                "model_type": mc.model_type,
                "layer_pattern": mc.layer_pattern,
                "vocab_size": mc.vocab_size,
                "hidden_size": mc.hidden_size,
                "num_hidden_layers": mc.num_hidden_layers,
                "max_position_embeddings": mc.max_position_embeddings,
                "num_experts": mc.num_experts,
            },
            "stats": async_engine.stats(),
        }

    @app.post("/flush_cache", dependencies=auth)
    async def flush_cache():
        try:
            return await asyncio.wrap_future(async_engine.flush_cache())
        except EngineDead as e:
            raise APIError(503, str(e), code="engine_unavailable") from None

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


# -- responses -----------------------------------------------------------------------------------------------


def _head(server: Server, job: Job, prefix: str, kind: str) -> dict:
    return {
        "id": f"{prefix}-{job.id}",
        "object": kind,
        "created": int(time.time()),
        "model": server.model_name,
    }


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
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
    except EngineDead as e:
        yield _event(error_body(str(e), "server_error", code="engine_unavailable"))
        yield _event("[DONE]")
    except Exception:
        log.exception("error while streaming a response")
        yield _event(error_body("internal server error", "server_error"))
        yield _event("[DONE]")


async def _chat_stream(server: Server, job: Job, req: ChatCompletionRequest) -> AsyncIterator[str]:
    head = _head(server, job, "chatcmpl", "chat.completion.chunk")
    usage = {"usage": None} if req.include_usage else {}

    async def events():
        for i in range(len(job.choices)):
            delta = {"role": "assistant", "content": ""}
            yield _event({**head, "choices": [_chunk_choice(i, delta, None, None)], **usage})
        async for index, piece, out, choice in job.events():
            logprobs = None
            if req.logprobs and out.new_logprobs:
                logprobs = {"content": chat_logprobs(server.tokenizer, out.new_logprobs)}
            if not (piece or logprobs or choice.finished):
                continue  # text held back (a partial character or a possible stop string)
            delta = {"content": piece} if piece else {}
            reason = choice.finish_reason if choice.finished else None
            yield _event({**head, "choices": [_chunk_choice(index, delta, logprobs, reason)], **usage})
        if req.include_usage:
            yield _event({**head, "choices": [], "usage": job.usage()})
        yield _event("[DONE]")

    async for e in _stream_errors(events()):
        yield e


def _chunk_choice(index: int, delta: dict, logprobs, finish_reason) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


async def _completion_stream(server: Server, job: Job, req: CompletionRequest) -> AsyncIterator[str]:
    head = _head(server, job, "cmpl", "text_completion")
    usage = {"usage": None} if req.include_usage else {}

    def chunk(index, text, logprobs, reason):
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return _event({**head, "choices": [choice], **usage})

    async def events():
        for i, choice in enumerate(job.choices):
            if choice.text:  # echo
                yield chunk(i, choice.text, None, None)
        async for index, piece, out, choice in job.events():
            logprobs = None
            if req.logprobs is not None and out.new_logprobs:
                n = len(out.new_logprobs)
                logprobs = completion_logprobs(server.tokenizer, out.new_logprobs, choice.text_offsets[-n:])
            if not (piece or logprobs or choice.finished):
                continue
            yield chunk(index, piece, logprobs, choice.finish_reason if choice.finished else None)
        if req.include_usage:
            yield _event({**head, "choices": [], "usage": job.usage()})
        yield _event("[DONE]")

    async for e in _stream_errors(events()):
        yield e


def _native_result(server: Server, job: Job, index: int, req: GenerateRequest) -> dict:
    c = job.choices[index]
    reason = None
    if c.finish_reason == "length":
        reason = {"type": "length", "length": len(c.token_ids)}
    elif c.finish_reason is not None:
        reason = {"type": c.finish_reason, "matched": c.stop_reason}
    meta = {
        "id": job.group.request_ids[index],
        "finish_reason": reason,
        "prompt_tokens": job.prompt_len(index),
        "completion_tokens": len(c.token_ids),
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in c.logprobs]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [[[v, t] for t, v in lp.top] for lp in c.logprobs]
    return {"text": c.text, "output_ids": list(c.token_ids), "meta_info": meta}


async def _generate_stream(server: Server, job: Job, req: GenerateRequest) -> AsyncIterator[str]:
    async def events():
        async for index, piece, out, choice in job.events():
            if piece or out.new_token_ids or choice.finished:
                yield _event({**_native_result(server, job, index, req), "index": index})
        yield _event("[DONE]")

    async for e in _stream_errors(events()):
        yield e


async def _finish_unless_disconnected(request: Request, job: Job) -> bool:
    """Run the job to the end; False (and the job aborted) if the client disconnects first."""
    done = asyncio.ensure_future(job.drain())
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            done.cancel()  # closing its events() aborts the requests
            await asyncio.gather(done, return_exceptions=True)
    if done.cancelled():
        return False
    exc = done.exception()
    if isinstance(exc, EngineDead):
        raise APIError(503, str(exc), code="engine_unavailable")
    if exc is not None:
        raise exc
    return True


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- errors --------------------------------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        err = APIError(e.status_code, message)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)
