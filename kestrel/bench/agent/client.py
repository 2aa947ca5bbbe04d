"""The benchmark's side of the server: streamed chat completions timed chunk by chunk (`Client`,
`Reply`), and start-up probing (`connect`): the model, its context limit, the stream extensions the server
accepts and its characters per token (`ServerProfile`)."""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from kestrel.bench.agent.config import (
    CALIBRATION_CHARS,
    CONTEXT_SLACK_TOKENS,
    DEFAULT_CHARS_PER_TOKEN,
    AgentBenchConfig,
)
from kestrel.bench.agent.workload import TextSizer, TextSource
from kestrel.utils.errors import KestrelError


@dataclass
class Reply:
    """One streamed chat completion, as the client saw it. Times in seconds from sending the request."""

    ok: bool
    text: str = ""
    error: str | None = None
    status: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None  # first chunk that carries text
    e2e_s: float | None = None
    decode_s: float | None = None  # first to last text chunk
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it
    usage_exact: bool = False
    num_chunks: int = 0
    itls: list[float] = field(default_factory=list)  # gaps between text chunks


@dataclass
class ServerProfile:
    """What start-up learned about the server."""

    model: str
    models: list[str]
    max_model_len: int | None
    ignore_eos: bool  # the server accepts "ignore_eos": true
    include_usage: bool  # the server accepts stream_options.include_usage
    chars_per_token: float
    token_counter: str  # tokenizer | fixed | measured | assumed
    info: dict | None  # /get_server_info at start-up, where the server has it
    tokenizer: object = field(default=None, repr=False)  # with --tokenizer


class Client:
    """Streaming chat completions and the few GET endpoints the benchmark reads, over one httpx client."""

    def __init__(self, http, cfg: AgentBenchConfig):
        self.http, self.cfg = http, cfg
        self.base = cfg.base_url.rstrip("/")
        self.root = re.sub(r"/v1$", "", self.base)
        self.model = cfg.model or ""
        self.ignore_eos, self.include_usage = True, True

    async def get(self, url: str):
        """The response of a GET, or None on a connection problem."""
        import httpx

        try:
            return await self.http.get(url, timeout=30)
        except (httpx.HTTPError, httpx.InvalidURL):
            return None

    async def get_json(self, url: str) -> dict | None:
        resp = await self.get(url)
        if resp is None or resp.status_code != 200:
            return None
        try:
            body = resp.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def chat(self, messages: list[dict], max_tokens: int) -> Reply:
        import httpx

        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.cfg.temperature,
            "stream": True,
        }
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.cfg.token_chunks:
            body["logprobs"] = True
        reply, pieces = Reply(ok=False), []
        start = time.perf_counter()
        first = last = None
        try:
            async with self.http.stream("POST", f"{self.base}/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    reply.status = resp.status_code
                    reply.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                    return reply
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        reply.error = f"stream error: {_error_message(chunk)}"
                        return reply
                    if chunk.get("usage"):
                        _read_usage(reply, chunk["usage"])
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        piece = delta.get("content") or ""
                        tokens = self.cfg.token_chunks and ((choice.get("logprobs") or {}).get("content"))
                        if piece or tokens or delta.get("reasoning_content") or delta.get("reasoning"):
                            now = time.perf_counter()
                            if first is None:
                                first = now
                            else:
                                reply.itls.append(now - last)
                            last = now
                            reply.num_chunks += 1
                            pieces.append(piece)
                        if choice.get("finish_reason"):
                            reply.finish_reason = choice["finish_reason"]
        except httpx.HTTPError as e:
            reply.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return reply
        except ValueError as e:
            reply.error = f"a malformed stream event: {e}"
            return reply
        end = time.perf_counter()
        reply.ok, reply.text, reply.e2e_s = True, "".join(pieces), end - start
        if first is not None:
            reply.ttft_s, reply.decode_s = first - start, last - first
        if reply.completion_tokens is None:  # no usage: count text chunks
            reply.completion_tokens = reply.num_chunks
        return reply


def _read_usage(reply: Reply, usage: dict) -> None:
    reply.prompt_tokens = usage.get("prompt_tokens")
    reply.completion_tokens = usage.get("completion_tokens")
    reply.usage_exact = reply.prompt_tokens is not None and reply.completion_tokens is not None
    details = usage.get("prompt_tokens_details") or {}
    reply.cached_tokens = details.get("cached_tokens")


def _error_message(body: bytes | dict) -> str:
    if isinstance(body, bytes):
        try:
            body = json.loads(body)
        except ValueError:
            return body.decode(errors="replace").strip()[:300] or "(empty body)"
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


async def connect(client: Client, cfg: AgentBenchConfig) -> ServerProfile:
    """Find the model, the context limit and the stream features the server accepts, and measure its
    characters per token; every way this can fail is a one-line KestrelError."""
    resp = await client.get(f"{client.base}/models")
    if resp is None:
        raise KestrelError(f"cannot reach the server at {cfg.base_url} (is it running? check --base-url)")
    if resp.status_code in (401, 403):
        raise KestrelError(f"the server refused the request (HTTP {resp.status_code}); check --api-key")
    cards = []
    if resp.status_code == 200:
        try:
            cards = [c for c in resp.json().get("data", []) if isinstance(c, dict) and "id" in c]
        except (ValueError, AttributeError):
            cards = []
    models = [c["id"] for c in cards]
    if cfg.model is None and not models:
        raise KestrelError(f"{cfg.base_url}/models lists no model; pass --model")
    if cfg.model is not None and models and cfg.model not in models:
        raise KestrelError(f"the server does not serve {cfg.model!r}; it serves {', '.join(models)}")
    client.model = cfg.model or models[0]
    card = next((c for c in cards if c["id"] == client.model), {})
    max_model_len = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) else None

    # Drop the extensions the server refuses (400/422), most specific first.
    calibration = TextSource(random.Random(f"{cfg.seed}:calibration"))
    small = TextSizer(1.0).cut(calibration.tool_block, CALIBRATION_CHARS[0])
    reply = None
    for ignore_eos, include_usage in ((True, True), (False, True), (False, False)):
        client.ignore_eos, client.include_usage = ignore_eos, include_usage
        reply = await client.chat([{"role": "user", "content": small}], 1)
        if reply.ok or reply.status not in (400, 422):
            break
    if not reply.ok:
        raise KestrelError(f"the server refused a chat completion for {client.model!r}: {reply.error}")

    token_counter, tokenizer, chars_per_token = "assumed", None, DEFAULT_CHARS_PER_TOKEN
    if cfg.tokenizer is not None:
        from kestrel.tokenizer import load_tokenizer

        path = Path(cfg.tokenizer)
        tokenizer = load_tokenizer(str(path.parent if path.is_file() else path))
        token_counter = "tokenizer"
    elif cfg.chars_per_token is not None:
        token_counter, chars_per_token = "fixed", cfg.chars_per_token
    elif reply.usage_exact:
        big_chars = (
            CALIBRATION_CHARS[1] if max_model_len is None else min(CALIBRATION_CHARS[1], max_model_len // 2)
        )
        big = small + TextSizer(1.0).cut(calibration.tool_block, big_chars - len(small))
        second = await client.chat([{"role": "user", "content": big}], 1)
        if second.ok and second.usage_exact and second.prompt_tokens > reply.prompt_tokens:
            measured = (len(big) - len(small)) / (second.prompt_tokens - reply.prompt_tokens)
            token_counter, chars_per_token = "measured", min(16.0, max(0.25, measured))
    info = await client.get_json(f"{client.root}/get_server_info")
    profile = ServerProfile(
        client.model, models, max_model_len, client.ignore_eos, client.include_usage,
        chars_per_token, token_counter, info, tokenizer,
    )  # fmt: skip
    if max_model_len is not None:
        need = cfg.history_tokens + cfg.append_tokens.hi + cfg.reply_tokens.hi + CONTEXT_SLACK_TOKENS
        if need > max_model_len:
            raise KestrelError(
                f"--history-tokens {cfg.history_tokens} + the longest --append-tokens and --reply-tokens "
                f"(+{CONTEXT_SLACK_TOKENS} for the chat template) = {need} tokens exceed the server's context "
                f"of {max_model_len}"
            )
    return profile
