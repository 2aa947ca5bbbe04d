"""What the HTTP layer keeps per server and per request: `Server` (the engine, the tokenizer, the served name,
the API key, the metrics; model and key checks, encoding and submission with their HTTP errors) and `Job` (the
engine requests behind one HTTP request and their choices as they stream)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request

from kestrel.engine.async_engine import AsyncEngine, EngineDead, Overloaded, RequestGroup
from kestrel.engine.engine import RequestError
from kestrel.engine.outputs import StepOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.serve.choice import ChoiceState
from kestrel.serve.errors import APIError, bad_request
from kestrel.serve.metrics import ServerMetrics
from kestrel.serve.reasoning_parsers import CLOSE as THINK_CLOSE
from kestrel.serve.reasoning_parsers import OPEN as THINK_OPEN
from kestrel.serve.reasoning_parsers import reasoning_parser as reasoning_parser_named
from kestrel.serve.reply import Parsers
from kestrel.serve.tool_parsers import tool_call_parser as tool_parser_named
from kestrel.serve.tools import auto_parser

RETRY_AFTER_S = 1  # what an overloaded server asks a client to wait
_PROMPT_TAIL = 512  # the prompt's last tokens read for a thought it opened or closed


class Job:
    """The engine requests behind one HTTP request: prompts x n choices, choice index = prompt * n + sample."""

    def __init__(
        self,
        server: Server,
        prompts: list[list[int]],
        params: SamplingParams,
        prefixes: list[str] | None = None,
        field_names: dict[str, str] | None = None,
        echo_only: bool = False,
    ):
        """`field_names`: the request's names for the engine's fields (`prompt`, `max_tokens`, `n`, the token-id
        fields), for error bodies;
        `prefixes` and `echo_only` as ChoiceState's."""
        children = params.children()
        self.server, self.prompts, self.params = server, prompts, params
        self.id = uuid.uuid4().hex
        items = [(prompt, child) for prompt in prompts for child in children]
        self.group: RequestGroup = server.submit(items, self.id, field_names or {})
        prefixes = prefixes or [""] * len(prompts)
        self.choices = [
            ChoiceState(server.tokenizer, prompt, child, prefix, echo_only)
            for prompt, prefix in zip(prompts, prefixes)
            for child in children
        ]
        self._prompt_of = [i for i in range(len(prompts)) for _ in children]
        self._admitted = [False] * len(self.choices)  # each choice's queue time observed
        self.group.on_late = self._see_admission  # a choice aborted before its first output was read

    async def events(self) -> AsyncIterator[tuple[int, str, StepOutput, ChoiceState]]:
        """(choice index, new text, the engine output, the choice) for each output, until all finish."""
        metrics, arrival = self.server.metrics, self.group.arrival_time
        try:
            async for index, out in self.group:
                self._see_admission(index, out)
                choice = self.choices[index]
                if choice.finished:
                    continue
                first, last = choice.first_token_time, choice.last_token_time
                piece = choice.update(out)
                metrics.on_tokens(arrival, first, last, len(out.new_token_ids))
                if choice.finished:
                    self._count_finished(index, choice.finish_reason)
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
                self._count_finished(index, reason)

    def _see_admission(self, index: int, out: StepOutput) -> None:
        """The queue time of each choice's request, once: from its first output, or (aborted before any
        was read) from what the engine says after the abort."""
        if not self._admitted[index] and out.queue_time is not None:
            self._admitted[index] = True
            self.server.metrics.on_admitted(out.queue_time)

    def _count_finished(self, index: int, reason: str | None) -> None:
        """Each choice is a finished request by its own reason; its prompt's tokens count once, with the last of
        the prompt's n choices (as vLLM counts them), not once per choice."""
        prompt = self._prompt_of[index]
        last = all(c.finished for c, p in zip(self.choices, self._prompt_of) if p == prompt)
        num_prompt_tokens = len(self.prompts[prompt]) if last else 0
        choice = self.choices[index]
        self.server.metrics.on_finished(
            self.group.arrival_time,
            num_prompt_tokens,
            reason,
            len(choice.token_ids),
            (choice.scheduled_time, choice.first_token_time, choice.last_token_time),
        )

    async def drain(self) -> None:
        async for _ in self.events():
            pass

    def prompt_len(self, index: int) -> int:
        return len(self.prompts[self._prompt_of[index]])

    def usage(self) -> dict:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix cache gave, each
        prompt counted once (as its tokens are), by its first choice's request."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        first = {}  # prompt -> its first choice
        for choice, p in zip(self.choices, self._prompt_of):
            first.setdefault(p, choice)
        cached = sum(c.num_cached_tokens for c in first.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


MAX_REQUEST_MB = 64  # a request body past this is refused before it is read whole (413)


def _as_bad_request(e: RequestError, field_names: dict[str, str]) -> APIError:
    param, message = field_names.get(e.param, e.param), str(e)
    # The message names the engine's field (max_tokens, n): say the one the client sent. (It speaks of the prompt
    # as a thing, which stays so whatever the request calls it.)
    if e.param not in (param, "prompt") and e.param is not None:
        message = re.sub(rf"\b{re.escape(e.param)}\b", param, message)
    return bad_request(message, param=param, code=e.code)


class Server:
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str | Sequence[str],
        api_key: str | None,
        max_request_mb: float = MAX_REQUEST_MB,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        # the names a request may give (vLLM's several served names); the first is the one replies report
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        self.model_names, self.model_name = tuple(names), names[0]
        self.engine, self.api_key = engine, api_key
        self.tool_parser = tool_parser_named(tool_call_parser)
        self.reasoning_parser = reasoning_parser_named(reasoning_parser)
        self.max_request_mb = max_request_mb
        self.tokenizer = engine.engine.tokenizer
        self.metrics = ServerMetrics(engine.stats, self.model_name)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {' or '.join(map(repr, self.model_names))}",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None

    async def encode_off_loop(self, prompts: list, param: str) -> list[list[int]]:
        """Each text prompt tokenized (token-id prompts as they are) in a worker thread: a long prompt takes
        seconds (10 MB of text: 8 s), which on the event loop held up every other request and /health."""
        return await asyncio.to_thread(
            lambda: [self.encode(p, param) if isinstance(p, str) else p for p in prompts]
        )

    async def decode_off_loop(self, prompts: list) -> list[str]:
        """Each token-id prompt as text (text prompts as they are) in a worker thread, as `encode_off_loop`
        (echoing 4.5 M ids decoded them on the event loop for 2.6 s); special tokens' text kept, as vLLM's echo
        and /detokenize have it."""
        return await asyncio.to_thread(
            lambda: [
                p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False)
                for p in prompts
            ]
        )

    async def read_body(self, request: Request) -> bytes:
        """The request's body, or a 413 as soon as it passes `max_request_mb` (by its declared length first,
        reading nothing)."""
        limit = int(self.max_request_mb * 2**20)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        message = f"the request body is larger than this server takes ({self.max_request_mb:g} MiB; --max-request-mb)"
        return APIError(413, message, code="request_too_large")

    def parsers(self, req, tools) -> Parsers:
        """The parsers that read a request's reply: the reasoning where the server has a reasoning parser (a
        constraint then holds from after the thought: `sampling_params`), unless the reply is tool calls held to
        their schemas (tool_choice "required" or named: no thought before them); the calls where the model decides
        on them (`tools`: the request's tools as the chat route's; a 400 where the server has no tool-call
        parser)."""
        reasoning = self.reasoning_parser if req.tool_calls_asked is None else None
        max_calls = 1 if tools.parallel_tool_calls is False else None
        # (under a constraint a call's opening inside the thought is the thought's text: the constraint's answer
        # comes after its </think>)
        calls_end_thought = req.constraint_field is None
        return Parsers(reasoning, auto_parser(tools, self.tool_parser), max_calls, calls_end_thought)

    def see_prompt(self, parsers: Parsers, prompt: list[int]) -> None:
        """What the prompt's end says of the reply's thought: a `<think>` left open (the template's thinking mode,
        or an assistant turn continued inside its thought) opens it; a `</think>` the prompt ends with (thinking
        switched off, as Qwen 3's template writes an empty thought) leaves no thought to read."""
        if parsers.reasoning is None:
            return
        end = self.tokenizer.decode(prompt[-_PROMPT_TAIL:], skip_special_tokens=False)
        opened, closed = end.rfind(THINK_OPEN), end.rfind(THINK_CLOSE)
        if opened > closed:
            parsers.opened = True
        elif closed >= 0 and not end[closed + len(THINK_CLOSE) :].strip():
            parsers.reasoning = None

    async def sampling_params(
        self, req, field_names: dict[str, str], parsers: Parsers | None = None
    ) -> SamplingParams:
        """A request's SamplingParams. Where it constrains the output they are made, and its grammar compiled (the
        engine keeps it), in a worker thread: a large JSON schema takes a second (a 300-branch anyOf: 1.4 s),
        which on the event loop held up every other stream. The grammar's errors are 400s naming the request's
        own field, as `field_names` will for the engine's later errors. `parsers`: those that will read the reply
        (`see_prompt` has seen its prompt), whose markers may be special tokens (kept in the text then, as vLLM
        does); where they read a thought, a constraint holds from after it."""
        thought = None
        if parsers is not None and parsers.reasoning is not None:
            thought = "opened" if parsers.opened or parsers.reasoning.opens_inside else "optional"
        params = await self._sampling_params(req, field_names, thought)
        if parsers is not None and parsers.keeps_special_tokens:
            params.skip_special_tokens = False
        return params

    async def _sampling_params(self, req, field_names: dict[str, str], thought: str | None) -> SamplingParams:
        field = req.constraint_field
        if field is None:
            return req.to_sampling_params()
        field_names["structured_outputs"] = field

        def made() -> SamplingParams:
            params = req.to_sampling_params()
            if params.structured_outputs is not None:
                if thought is not None:
                    params.structured_outputs = dataclasses.replace(
                        params.structured_outputs, thought=thought
                    )
                self.engine.engine.grammar_of(params)
            return params

        try:
            return await asyncio.to_thread(made)
        except RequestError as e:
            raise _as_bad_request(e, field_names) from None

    def submit(self, items, request_id: str, field_names: dict[str, str]) -> RequestGroup:
        try:
            return self.engine.submit(items, request_id)
        except RequestError as e:
            raise _as_bad_request(e, field_names) from None
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
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
