"""The HTTP server: `build_app(async_engine, served_model_name, api_key)` returns a FastAPI app.

Endpoints
- POST /v1/chat/completions, POST /v1/completions: OpenAI-compatible, streaming (SSE, ending `data: [DONE]`)
  or not; `n` choices, `stop`, `seed`, `logprobs`, `usage` (in a stream: a last chunk with `choices: []`
  when `stream_options.include_usage`; the usage so far in every chunk too with vLLM's
  `stream_options.continuous_usage_stats`).
- POST /v1/responses: OpenAI's Responses API, stateless (`input`, `instructions`, `max_output_tokens`, function
  tools; a stream of typed events); nothing is stored.
- POST /v1/messages, POST /v1/messages/count_tokens: Anthropic's Messages API (`kestrel.serve.messages_protocol`),
  its errors in Anthropic's shape.
- POST /generate: native, SGLang-style (`text` or `input_ids`, a `sampling_params` dict with
  `max_new_tokens`); a stream sends each choice's whole text so far in every event (SGLang's default).
- GET /v1/models, GET /health (503 once the engine thread has failed; /ping the same, GET or POST, as vLLM's),
  GET /version, GET /get_server_info (engine config,
  memory plan, pool and prefix-cache stats), GET /metrics (Prometheus text); each answers HEAD too.
- POST /tokenize (`prompt`, or chat `messages` with `add_generation_prompt`, `continue_final_message`): the token
  ids the completion routes would feed the model, their count and the context limit; POST /detokenize
  (`tokens`): their text. vLLM's routes and fields.
- POST /flush_cache: drop every cached prefix no running request uses, in every tier (GPU, host, disk); answers
  what was freed.

With `allowed_origins` (`serve --allowed-origins`), web pages from those origins may call the API from a browser
(CORS, preflights answered; vLLM allows every origin by default, Kestrel none unless asked). With an API key,
every endpoint but /health, /ping and /metrics needs `Authorization: Bearer <key>` or `x-api-key: <key>` (401
otherwise):
load balancers and Prometheus scrape those without credentials, and none reveals request data.
Error statuses are described in `kestrel.serve.errors`. Detokenization and stop-string truncation run here,
on the event loop, so the engine thread only steps the model. A client that disconnects (mid-stream, or while
waiting for a non-streamed answer) has its requests aborted, which frees their KV pages and state slots.
Per-request state: `kestrel.serve.jobs`; the response bodies and streams: `kestrel.serve.streams`
(the Responses API's: `kestrel.serve.responses_streams`; the Messages API's: `kestrel.serve.messages_streams`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kestrel.engine.async_engine import AsyncEngine, EngineDead
from kestrel.serve.choice import chat_logprobs, choice_logprobs
from kestrel.serve.errors import CODE_BY_STATUS, APIError, anthropic_error_body, bad_request, error_body
from kestrel.serve.jobs import MAX_REQUEST_MB, Job, Server
from kestrel.serve.messages_protocol import CountTokensRequest, MessagesRequest
from kestrel.serve.messages_streams import message_body, message_stream
from kestrel.serve.metrics import CONTENT_TYPE, CountResponses
from kestrel.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    parse,
)
from kestrel.serve.reply import Parsers, read_reply
from kestrel.serve.responses_protocol import ResponsesRequest
from kestrel.serve.responses_streams import response_body, responses_stream
from kestrel.serve.streams import (
    body_head,
    chat_stream,
    completion_stream,
    generate_stream,
    native_result,
    sse,
)
from kestrel.serve.tools import finish_reason as tool_finish_reason
from kestrel.serve.tools import read_tool_calls
from kestrel.utils.errors import KestrelError
from kestrel.version import KESTREL_VERSION

log = logging.getLogger("kestrel.serve")


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    max_request_mb: float = MAX_REQUEST_MB,
    allowed_origins: list[str] | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """`tool_call_parser`: the model's tool-call format (`kestrel.serve.tool_parsers`), read where tool_choice is
    "auto"; None: such requests are refused. `reasoning_parser`: the model's thinking format
    (`kestrel.serve.reasoning_parsers`); None: a reply is all answer."""
    server = Server(
        async_engine, served_model_name, api_key, max_request_mb, tool_call_parser, reasoning_parser
    )
    app = FastAPI(title="Kestrel", version=KESTREL_VERSION)
    app.state.server = server
    auth = [Depends(server.check_key)]
    _add_error_handlers(app)
    app.add_middleware(CountResponses, counter=server.metrics.responses)
    # outside the counter: a browser's preflight is answered here, not counted as a route's
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )

    def get(path: str, **kwargs):
        """A GET route that answers HEAD too: health probes and uptime monitors send HEAD, and HTTP asks every
        server that takes GET to take it (RFC 9110, 9.1); uvicorn sends the headers without the body. The HEAD
        route stays out of the OpenAPI schema, where it would repeat the GET's operation id."""

        def register(endpoint):
            app.head(path, include_in_schema=False, **kwargs)(endpoint)
            return app.get(path, **kwargs)(endpoint)

        return register

    async def chat_prompt(messages: list[dict], options: dict, param: str = "messages") -> list[list[int]]:
        """The messages through the chat template (`options`: its keyword arguments), tokenized: the one prompt
        a chat request is fed; `param`: the request's field that holds them, for errors."""
        try:
            text = server.tokenizer.apply_chat_template(messages, **options)
        except (ValueError, KestrelError) as e:
            raise bad_request(str(e), param=param) from None
        return await server.encode_off_loop([text], param)

    async def chat_job(req, tools, names: dict[str, str], param: str = "messages") -> tuple[Job, Parsers]:
        """A conversation's request (chat, Responses, Messages) as its job, and the parsers that read its reply
        (`tools`: the request's tools as the chat route's): its prompt rendered and seen, its sampling params
        made; `names`: the request's names for the engine's fields, `param` the one that holds the messages."""
        parsers = server.parsers(req, tools)
        prompt = await chat_prompt(req.chat_messages(), req.template_options(), param)
        server.see_prompt(parsers, prompt[0])
        params = await server.sampling_params(req, names, parsers)
        return Job(server, prompt, params, field_names=names), parsers

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await server.read_body(request))
        server.check_model(req.model)
        names = {"prompt": "messages", "max_tokens": req.max_tokens_field}
        job, parsers = await chat_job(req, req, names)
        if req.stream:
            return sse(chat_stream(server, job, req, parsers))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        choices = []
        for i, c in enumerate(job.choices):
            content, calls, reasoning = c.text, None, None
            if req.tool_calls_asked:
                calls = read_tool_calls(req, c.text)
                content = c.text if calls is None else None
            elif parsers:
                reply = read_reply(parsers, c.text)
                content, calls, reasoning = reply.content, reply.calls or None, reply.reasoning
            message = {"role": "assistant", "content": content}
            if reasoning is not None:  # SGLang's name and vLLM's
                message["reasoning_content"] = message["reasoning"] = reasoning
            if calls is not None:
                message["tool_calls"] = calls
            logprobs = {"content": chat_logprobs(server.tokenizer, c.logprobs)} if req.logprobs else None
            reason = tool_finish_reason(c.finish_reason, c.stop_reason, calls)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return JSONResponse(
            {
                **body_head(server, job, "chatcmpl", "chat.completion"),
                "choices": choices,
                "usage": job.usage(),
            }
        )

    @app.post("/v1/responses", dependencies=auth)
    async def responses(request: Request):
        req = parse(ResponsesRequest, await server.read_body(request))
        server.check_model(req.model)
        created = int(time.time())
        names = {"prompt": "input", "max_tokens": "max_output_tokens"}
        job, parsers = await chat_job(req, req.tool_view, names, "input")
        if req.stream:
            return sse(responses_stream(server, job, req, created, parsers))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        return JSONResponse(response_body(server, job, req, created, parsers=parsers))

    @app.post("/v1/messages", dependencies=auth)
    async def messages(request: Request):
        req = parse(MessagesRequest, await server.read_body(request))
        server.check_model(req.model)
        job, parsers = await chat_job(req, req.tool_view, {"prompt": "messages", "stop": "stop_sequences"})
        if req.stream:
            return sse(message_stream(server, job, req, parsers))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        return JSONResponse(message_body(server, job, req, parsers))

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_message_tokens(request: Request):
        req = parse(CountTokensRequest, await server.read_body(request))
        server.check_model(req.model)
        prompt = await chat_prompt(req.chat_messages(), req.template_options())
        return {"input_tokens": len(prompt[0])}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req = parse(CompletionRequest, await server.read_body(request))
        server.check_model(req.model)
        names: dict[str, str] = {}
        params = await server.sampling_params(req, names)
        prompts = await server.encode_off_loop(req.prompts(), "prompt")
        prefixes = await server.decode_off_loop(req.prompts()) if req.echo else None
        job = Job(server, prompts, params, prefixes, echo_only=req.echo_only, field_names=names)
        if req.stream:
            return sse(completion_stream(server, job, req))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        choices = [
            {
                "index": i,
                "text": c.text,
                "logprobs": None
                if req.logprobs is None
                else choice_logprobs(server.tokenizer, c, bool(req.echo)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for i, c in enumerate(job.choices)
        ]
        return JSONResponse(
            {**body_head(server, job, "cmpl", "text_completion"), "choices": choices, "usage": job.usage()}
        )

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await server.read_body(request))
        server.check_model(req.model)
        if req.messages is not None:
            (tokens,) = await chat_prompt(req.chat_messages(), req.template_options())
        else:
            (tokens,) = await server.encode_off_loop([req.prompt], "prompt")
        limit = async_engine.engine.plan.max_model_len
        return {"count": len(tokens), "max_model_len": limit, "tokens": tokens}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await server.read_body(request))
        server.check_model(req.model)
        vocab = async_engine.engine.model.config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the model's vocabulary [0, {vocab})", param="tokens"
            )
        (text,) = await server.decode_off_loop([req.tokens])
        return {"prompt": text}

    @app.post("/generate", dependencies=auth)
    async def generate(request: Request):
        req = parse(GenerateRequest, await server.read_body(request))
        param = "text" if req.text is not None else "input_ids"
        names = {"prompt": param, "max_tokens": "sampling_params.max_new_tokens"}
        names |= {
            k: f"sampling_params.{k}" for k in ("n", "stop_token_ids", "logit_bias", "allowed_token_ids")
        }
        params = await server.sampling_params(req, names)
        prompts = await server.encode_off_loop(req.prompts(), param)
        job = Job(server, prompts, params, field_names=names)
        if req.stream:
            return sse(generate_stream(server, job, req))
        if not await _finish_unless_disconnected(request, job):
            return Response(status_code=499)
        results = [native_result(server, job, i, req) for i in range(len(job.choices))]
        return JSONResponse(results if req.batched or params.n > 1 else results[0])

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "kestrel",
            "root": async_engine.engine.config.model,
            "max_model_len": async_engine.engine.plan.max_model_len,
        }

    @get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [model_card(name) for name in server.model_names]}

    @get("/v1/models/{model:path}", dependencies=auth)
    async def model(model: str):  # the openai client's models.retrieve(name)
        server.check_model(model)
        return model_card(model)

    @get("/health")
    async def health():
        if not async_engine.healthy:
            body = error_body(
                "the engine has failed; see the server log", "server_error", code="engine_unavailable"
            )
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    get("/ping")(health)  # vLLM's (SageMaker's probe), GET and POST
    app.post("/ping", include_in_schema=False)(health)

    @get("/version", dependencies=auth)
    async def version():  # vLLM's
        return {"version": KESTREL_VERSION}

    @get("/get_server_info", dependencies=auth)
    async def server_info():
        engine = async_engine.engine
        mc = engine.model.config
        return {
            "version": KESTREL_VERSION,
            "served_model_name": server.model_name,
            "served_model_names": list(server.model_names),
            "healthy": async_engine.healthy,
            "device": str(engine.device),
            "dtype": str(engine.model.lm_head.weight.dtype).removeprefix("torch."),
            # the settings as they took effect (chunked_prefill_size's default is the device's)
            "engine_config": {
                **dataclasses.asdict(engine.config),
                "chunked_prefill_size": engine.config.chunk_size(engine.device.type),
            },
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

    @get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


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
    def body(request: Request, e: APIError) -> dict:
        """OpenAI's error body, or Anthropic's on its Messages API's routes."""
        return anthropic_error_body(e) if request.url.path.startswith("/v1/messages") else e.body()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(body(request, e), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        err = APIError(e.status_code, message, code=CODE_BY_STATUS.get(e.status_code))
        return JSONResponse(
            body(request, err), status_code=e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect):
        # The client closed the connection before its body was whole (a cancelled upload, a proxy's timeout):
        # no answer is read, and it is not a server error, which logged two tracebacks for each.
        log.info(
            "%s %s: the client went away before sending its whole body", request.method, request.url.path
        )
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        err = APIError(500, "internal server error", code="internal_error")
        return JSONResponse(body(request, err), status_code=500)
