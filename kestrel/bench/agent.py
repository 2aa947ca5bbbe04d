"""`kestrel bench agent`: an agentic multi-turn workload against any OpenAI-compatible server, over a
concurrency sweep.

The workload (deterministic from `--seed`, so the same sessions can be replayed against other engines):
each session opens with a long system prompt and history (`--history-tokens`: procedurally generated tool
logs, code, grep hits, JSON lines and test reports; the first `--shared-prefix-tokens` are the same in every
session). Each turn appends a tool result (`--append-tokens`) as a user message, asks for a reply of
`--reply-tokens` (as `max_tokens`, with `ignore_eos` where the server accepts it), appends the server's reply
to the history, and waits a think time (`--think-time-s`) before the next turn. The history grows with the
model's own replies, so a server's prefix cache can reuse all of it. Each concurrency level runs as many
sessions as its concurrency, for `--turns` turns or `--duration-s` seconds; levels use fresh sessions, so one
level's cache does not serve the next.

Token lengths come from `--tokenizer` (exact), `--chars-per-token`, or by default a ratio measured on the
server at start-up from the `usage` of two short requests. Requests are streamed chat completions with
`stream_options.include_usage` (exact token counts); features the server refuses are dropped at start-up.

Per level: output tokens/s (and per GPU), per-user decode tokens/s, TTFT, TPOT, inter-chunk times, E2E
latency, and the server's prefix-cache hit rate over the level (the change in its hit and query token
counters, read from Kestrel's `/get_server_info` or from Prometheus `/metrics`; absent on servers without
them), per tier where the server splits them. Percentiles interpolate between ranks. Latency `p90` is the
slow tail (90% of requests were faster); per-user speed `p90` is the same tail, "P90 interactivity": 90% of
requests decoded at least this fast.

Output in `--out`: `agent.json` (config, command line, date, server info, per level a summary and every
request's record; rewritten after each level) and `agent.png` (throughput per GPU against per-user speed,
one labeled point per concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import re
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from kestrel.utils.errors import ConfigError, KestrelError
from kestrel.version import KESTREL_VERSION

DEFAULT_TURNS = 5
DEFAULT_CHARS_PER_TOKEN = 3.5  # code-like text, when the server reports no usage to measure it from
CONTEXT_SLACK_TOKENS = 64  # chat-template tokens around the messages, kept free below the context limit
CALIBRATION_CHARS = (256, 1536)
CLIENT_CPU_WARNING = 0.8  # of one core: past this, the single-threaded client may be the bottleneck


# -- configuration -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """A sampled quantity: a constant, uniform in [lo, hi], or exponential with mean `lo`."""

    kind: str  # const | uniform | exp
    lo: float
    hi: float

    @classmethod
    def parse(cls, text: str, integer: bool = False) -> Spread:
        """ "X" (constant), "A,B" (uniform) or "exp:MEAN"; ValueError with a readable message otherwise."""
        number = int if integer else float
        what = "integers" if integer else "numbers"
        try:
            if text.startswith("exp:") and not integer:
                mean = float(text[4:])
                if not mean > 0:
                    raise ValueError
                return cls("exp", mean, mean)
            parts = [number(p) for p in text.split(",")]
        except ValueError:
            form = "X, A,B" if integer else "X, A,B or exp:MEAN"
            raise ValueError(f"expected {form} with non-negative {what}, got {text!r}") from None
        if len(parts) not in (1, 2) or min(parts) < 0 or not all(math.isfinite(p) for p in parts):
            raise ValueError(f"expected X or A,B with non-negative {what}, got {text!r}")
        lo, hi = parts[0], parts[-1]
        if lo > hi:
            raise ValueError(f"the range {text!r} has its low end above its high end")
        return cls("const" if lo == hi else "uniform", lo, hi)

    def sample(self, rng: random.Random) -> float:
        if self.kind == "exp":
            return rng.expovariate(1 / self.lo)
        return rng.uniform(self.lo, self.hi)

    def sample_int(self, rng: random.Random) -> int:
        return int(round(self.sample(rng)))

    @property
    def mean(self) -> float:
        return self.lo if self.kind == "exp" else (self.lo + self.hi) / 2

    def __str__(self) -> str:
        g = lambda x: f"{x:g}"
        return {"const": g(self.lo), "uniform": f"{g(self.lo)},{g(self.hi)}", "exp": f"exp:{g(self.lo)}"}[
            self.kind
        ]


@dataclass(frozen=True)
class AgentBenchConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    concurrency: tuple[int, ...] = (1, 4, 16, 64, 256)
    turns: int | None = None  # None: DEFAULT_TURNS, or as many as fit in duration_s
    duration_s: float | None = None  # stop starting turns this long after a level starts
    history_tokens: int = 8192  # system prompt + history each session opens with
    shared_prefix_tokens: int = 0  # the start of the system prompt that every session shares
    append_tokens: Spread = Spread("uniform", 100, 2000)
    reply_tokens: Spread = Spread("uniform", 50, 500)
    think_time_s: Spread = Spread("uniform", 0, 2)
    num_gpus: int = 1
    seed: int = 0
    temperature: float = 0.0
    tokenizer: str | None = None  # folder (or tokenizer.json) to count tokens exactly
    chars_per_token: float | None = None  # None: measured on the server (or DEFAULT_CHARS_PER_TOKEN)
    request_timeout_s: float = 600.0

    def __post_init__(self):
        problems = []
        if not self.concurrency or min(self.concurrency) < 1:
            problems.append("--concurrency needs positive integers")
        if self.turns is not None and self.turns < 1:
            problems.append("--turns must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            problems.append("--duration-s must be > 0")
        if self.history_tokens < 1:
            problems.append("--history-tokens must be >= 1")
        if not 0 <= self.shared_prefix_tokens <= self.history_tokens:
            problems.append("--shared-prefix-tokens must be in [0, --history-tokens]")
        if self.append_tokens.lo < 1 or self.reply_tokens.lo < 1:
            problems.append("--append-tokens and --reply-tokens must be >= 1")
        if self.num_gpus < 1:
            problems.append("--num-gpus must be >= 1")
        if self.chars_per_token is not None and not self.chars_per_token > 0:
            problems.append("--chars-per-token must be > 0")
        if not self.request_timeout_s > 0:
            problems.append("--request-timeout-s must be > 0")
        if not self.base_url.startswith(("http://", "https://")):
            problems.append(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def max_turns(self) -> int | None:
        if self.turns is not None:
            return self.turns
        return None if self.duration_s is not None else DEFAULT_TURNS

    def command_line(self) -> str:
        """The `kestrel bench agent` command that reproduces this workload (the API key masked)."""
        argv = ["kestrel", "bench", "agent", "--base-url", self.base_url]
        if self.model:
            argv += ["--model", self.model]
        if self.api_key:
            argv += ["--api-key", "***"]
        argv += ["--concurrency", ",".join(map(str, self.concurrency))]
        if self.turns is not None:
            argv += ["--turns", str(self.turns)]
        if self.duration_s is not None:
            argv += ["--duration-s", f"{self.duration_s:g}"]
        argv += ["--history-tokens", str(self.history_tokens)]
        argv += ["--shared-prefix-tokens", str(self.shared_prefix_tokens)]
        argv += ["--append-tokens", str(self.append_tokens), "--reply-tokens", str(self.reply_tokens)]
        argv += ["--think-time-s", str(self.think_time_s), "--num-gpus", str(self.num_gpus)]
        argv += ["--seed", str(self.seed), "--temperature", f"{self.temperature:g}"]
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        if self.chars_per_token is not None:
            argv += ["--chars-per-token", f"{self.chars_per_token:g}"]
        return shlex.join(argv)


# -- generated text ------------------------------------------------------------------------------------------

_NOUNS = (
    "request", "session", "page", "slot", "token", "batch", "kernel", "stream", "cache", "tensor", "layer",
    "expert", "router", "buffer", "offset", "handle", "config", "state", "queue", "worker", "chunk", "prefix",
    "index", "score", "shard", "rank", "block", "graph", "sampler", "pool", "tree", "node", "span", "frame",
)  # fmt: skip
_VERBS = (
    "load", "build", "check", "merge", "split", "evict", "match", "insert", "flush", "sync", "read", "write",
    "resolve", "allocate", "release", "schedule", "retry", "decode", "encode", "verify", "trace", "patch",
)  # fmt: skip
_TOOLS = ("bash", "read_file", "grep", "run_tests", "git_diff", "http_get", "python", "list_dir")
_LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR")
_TYPES = ("int", "str", "float", "bool", "list[int]", "dict[str, int]", "Tensor", "None")
_OUTCOMES = ("PASSED",) * 6 + ("FAILED", "SKIPPED")


def _ident(r: random.Random) -> str:
    return f"{r.choice(_VERBS)}_{r.choice(_NOUNS)}"


def _path(r: random.Random) -> str:
    return f"src/{r.choice(_NOUNS)}/{r.choice(_NOUNS)}_{r.choice(_NOUNS)}.py"


def _log_line(r: random.Random) -> str:
    return (
        f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:"
        f"{r.randint(0, 59):02d}.{r.randint(0, 999):03d}Z {r.choice(_LEVELS):<5} {r.choice(_NOUNS)}"
        f"[{r.randint(100, 99999)}]: {r.choice(_VERBS)} {r.choice(_NOUNS)}={r.randint(0, 65535)} "
        f"{r.choice(_NOUNS)}_ms={r.random() * 100:.2f}"
    )


def _code_line(r: random.Random) -> str:
    indent = "    " * r.randint(0, 3)
    kind = r.randrange(4)
    if kind == 0:
        return f"def {_ident(r)}(self, {r.choice(_NOUNS)}: {r.choice(_TYPES)}) -> {r.choice(_TYPES)}:"
    if kind == 1:
        return f"{indent}{r.choice(_NOUNS)} = self.{_ident(r)}({r.choice(_NOUNS)}, {r.randint(0, 4096)})"
    if kind == 2:
        return f"{indent}if {r.choice(_NOUNS)}.{r.choice(_NOUNS)} >= {r.randint(1, 512)}:"
    return f"{indent}return {r.choice(_NOUNS)}[{r.randint(0, 63)}:{r.randint(64, 4096)}]"


def _grep_line(r: random.Random) -> str:
    return f"{_path(r)}:{r.randint(1, 2000)}:{_code_line(r).strip()}"


def _json_line(r: random.Random) -> str:
    status = r.choice(("ok", "ok", "ok", "retry", "error"))
    return (
        f'{{"id": "{r.getrandbits(32):08x}", "status": "{status}", "{r.choice(_NOUNS)}": '
        f'{r.randint(0, 1 << 20)}, "latency_ms": {r.random() * 500:.1f}}}'
    )


def _test_line(r: random.Random) -> str:
    return (
        f"tests/test_{r.choice(_NOUNS)}.py::test_{_ident(r)} {r.choice(_OUTCOMES)} [{r.randint(0, 100):3d}%]"
    )


_LINE_KINDS = (_log_line, _code_line, _grep_line, _json_line, _test_line)


class TextSource:
    """An endless seeded stream of agent-session text: tool outputs (blocks of one kind of line under a
    tool header) and assistant prose."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def tool_block(self) -> str:
        r = self.rng
        line = r.choice(_LINE_KINDS)
        head = (
            f"[{r.choice(_TOOLS)} {_path(r)}] exit_code={r.choice((0, 0, 0, 1))} ms={r.randint(1, 30000)}\n"
        )
        return head + "\n".join(line(r) for _ in range(r.randint(8, 40))) + "\n"

    def sentence(self) -> str:
        r = self.rng
        return (
            f"I will {r.choice(_VERBS)} the {r.choice(_NOUNS)} {r.choice(_NOUNS)} in {_path(r)}, then "
            f"{r.choice(_VERBS)} `{_ident(r)}` and {r.choice(_VERBS)} the {r.choice(_NOUNS)} tests. "
        )

    def tool_spec(self) -> str:
        r = self.rng
        signature = f"{r.choice(_TOOLS)}({r.choice(_NOUNS)}: {r.choice(_TYPES)}) -> {r.choice(_TYPES)}"
        return f"- {signature}: {self.sentence()}\n"


class TextSizer:
    """Cuts generated text to a token count: exactly with a tokenizer, else by a characters-per-token ratio."""

    def __init__(self, chars_per_token: float, tokenizer=None):
        self.chars_per_token, self.tokenizer = chars_per_token, tokenizer

    def cut(self, produce: Callable[[], str], num_tokens: int, head: str = "") -> str:
        """`head` followed by produced pieces, num_tokens in all."""
        if num_tokens <= 0:
            return ""
        if self.tokenizer is None:
            want = max(1, round(num_tokens * self.chars_per_token))
            parts, size = [head], len(head)
            while size < want:
                parts.append(produce())
                size += len(parts[-1])
            return "".join(parts)[:want]
        text = head
        while True:
            while len(text) < 6 * num_tokens:  # more characters than tokens, for any usual tokenizer
                text += produce()
            ids = self.tokenizer.encode(text)
            if len(ids) >= num_tokens:
                return self.tokenizer.decode(ids[:num_tokens])
            text += produce()

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return round(len(text) / self.chars_per_token)
        return len(self.tokenizer.encode(text))


# -- sessions ------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    append: str  # the tool result sent as a user message
    append_tokens: int
    reply_tokens: int  # max_tokens
    think_s: float  # waited before sending this turn (0 for the first)


class SessionPlan:
    """One session's deterministic script: its opening messages and, turn by turn, what it appends."""

    def __init__(self, cfg: AgentBenchConfig, sizer: TextSizer, shared_prefix: str, level: int, index: int):
        key = f"{cfg.seed}:{level}:{index}"
        self.cfg, self.sizer = cfg, sizer
        self.name = f"agent-{level}-{index}"
        self.rng = random.Random(key + ":turns")
        self.source = TextSource(random.Random(key + ":text"))
        self.messages = self._opening(shared_prefix)
        self.num_turns = 0

    def _opening(self, shared_prefix: str) -> list[dict]:
        cfg, src, cut = self.cfg, self.source, self.sizer.cut
        system_tokens = min(cfg.history_tokens, cfg.shared_prefix_tokens + cfg.history_tokens // 8)
        head = f"You are coding agent {self.name}. Use the tools below; think before each call.\n"
        own = cut(src.tool_spec, system_tokens - cfg.shared_prefix_tokens, head=head)
        messages = [{"role": "system", "content": shared_prefix + own}]
        rest = cfg.history_tokens - system_tokens
        per_pair = cfg.append_tokens.mean + cfg.reply_tokens.mean
        num_pairs = round(rest / per_pair)
        if num_pairs == 0:
            messages[0]["content"] += cut(src.tool_block, rest)
            return messages
        tool = round(rest * cfg.append_tokens.mean / per_pair / num_pairs)
        reply = round(rest * cfg.reply_tokens.mean / per_pair / num_pairs)
        for _ in range(num_pairs):
            messages.append({"role": "user", "content": cut(src.tool_block, tool)})
            messages.append({"role": "assistant", "content": cut(src.sentence, reply)})
        return messages

    def next_turn(self) -> Turn:
        cfg = self.cfg
        think = cfg.think_time_s.sample(self.rng) if self.num_turns else 0.0
        append_tokens = max(1, cfg.append_tokens.sample_int(self.rng))
        reply_tokens = max(1, cfg.reply_tokens.sample_int(self.rng))
        self.num_turns += 1
        return Turn(self.sizer.cut(self.source.tool_block, append_tokens), append_tokens, reply_tokens, think)


# -- the client ----------------------------------------------------------------------------------------------


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
                        if piece or delta.get("reasoning_content") or delta.get("reasoning"):
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


# -- server cache counters -----------------------------------------------------------------------------------


def _flatten(obj, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts and lists, keyed by dotted paths."""
    out: dict[str, float] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text samples summed over labels (histogram and summary series left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if m is None or m.group(1).endswith(("_bucket", "_sum", "_count")):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def _cache_keys(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if "hit" in k or "quer" in k}


async def read_cache_counters(client: Client) -> dict[str, dict[str, float]]:
    """The server's cache counters: {"server_info": {...}, "metrics": {...}} (empty where absent)."""
    info = await client.get_json(f"{client.root}/get_server_info")
    stats = info.get("stats", info) if info else {}
    metrics = {}
    resp = await client.get(f"{client.root}/metrics")
    if resp is not None and resp.status_code == 200:
        metrics = _parse_prometheus(resp.text)
    return {"server_info": _cache_keys(_flatten(stats)), "metrics": _cache_keys(metrics)}


def _query_key_for(hit_key: str, keys) -> str | None:
    for a, b in (("hit_tokens", "query_tokens"), ("hits", "queries"), ("hit", "query")):
        if a in hit_key and hit_key.replace(a, b) in keys:
            return hit_key.replace(a, b)
    return None


def cache_deltas(before: dict, after: dict, reusable_tokens: int) -> dict | None:
    """The server's cache hits over a level, from its counters before and after.

    Every hit counter with a query counter beside it (`x_hit_tokens`/`x_query_tokens`, `x_hits`/`x_queries`)
    is a tier; a hit counter without one is measured against the main query counter. The main tier is
    Kestrel's `cache_hit_tokens` where present. `reported` keeps the server's own (cumulative) hit rates.
    None when the server exposes no cache counters."""
    tiers, reported, main = {}, {}, None
    for source in ("server_info", "metrics"):
        b, a = before.get(source) or {}, after.get(source) or {}
        reported.update({f"{source}:{k}": v for k, v in a.items() if "hit_rate" in k})
        hit_keys = [k for k in a if "hit" in k and "rate" not in k and k in b]
        pairs = {k: _query_key_for(k, a) for k in hit_keys}
        for hit_key, query_key in pairs.items():
            if query_key is None or query_key not in b:
                continue
            tier = _tier(a[hit_key] - b[hit_key], a[query_key] - b[query_key])
            tiers[f"{source}:{hit_key}"] = tier
            if main is None or hit_key == "cache_hit_tokens":
                main = tier
        if main is not None:
            for hit_key, query_key in pairs.items():  # lower tiers counted against the main queries
                if query_key is None:
                    tiers[f"{source}:{hit_key}"] = _tier(a[hit_key] - b[hit_key], main["query_tokens"])
    if main is None and not reported:
        return None
    out = {"hit_rate": None, "hit_tokens": None, "query_tokens": None, "hit_of_reusable": None}
    if main is not None:
        out.update(main)
        out["hit_of_reusable"] = main["hit_tokens"] / reusable_tokens if reusable_tokens else None
    return {**out, "tiers": tiers, "reported": reported}


def _tier(hits: float, queries: float) -> dict:
    return {"hit_tokens": hits, "query_tokens": queries, "hit_rate": hits / queries if queries > 0 else None}


# -- statistics ----------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between closest ranks; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values) -> dict:
    """n, mean, p50, p90, p99, max; p90 and p99 are the slow tail."""
    xs = [v for v in values if v is not None]
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs) if xs else None,
    }


def speed_stats(values) -> dict:
    """n, mean, p50, p90 of a speed; p90 is the slow tail (90% of values are at least this)."""
    xs = [v for v in values if v is not None]
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 10),
    }


def summarize_level(records: list[dict], duration_s: float, num_gpus: int, itls=()) -> dict:
    """A level's figures from its request records (see `request_record`); `itls`: every inter-chunk gap."""
    ok = [r for r in records if r["ok"]]
    output = sum(r["completion_tokens"] or 0 for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = [r["cached_tokens"] for r in ok]
    rate = lambda x: x / duration_s if duration_s > 0 else None
    out_rate = rate(output)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(cached) if cached and None not in cached else None,
        "reusable_prompt_tokens": sum(r["reusable_tokens"] for r in ok),
        "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": out_rate,
        "output_tokens_per_s_per_gpu": None if out_rate is None else out_rate / num_gpus,
        "total_tokens_per_s": rate(prompt + output),
        "decode_tokens_per_s_per_user": speed_stats(r["decode_tokens_per_s"] for r in ok),
        "ttft_s": latency_stats(r["ttft_s"] for r in ok),
        "ttft_s_first_turn": latency_stats(r["ttft_s"] for r in ok if r["turn"] == 0),
        "ttft_s_later_turns": latency_stats(r["ttft_s"] for r in ok if r["turn"] > 0),
        "tpot_s": latency_stats(r["tpot_s"] for r in ok),
        "itl_s": latency_stats(itls),
        "e2e_s": latency_stats(r["e2e_s"] for r in ok),
    }


def request_record(reply: Reply, session: int, turn: Turn, index: int, start_s: float, reusable: int) -> dict:
    tokens = reply.completion_tokens or 0
    decoding = reply.decode_s is not None and reply.decode_s > 0 and tokens >= 2
    return {
        "session": session,
        "turn": index,
        "ok": reply.ok,
        "error": reply.error,
        "finish_reason": reply.finish_reason,
        "start_s": start_s,
        "think_s": turn.think_s,
        "append_tokens_target": turn.append_tokens,
        "max_tokens": turn.reply_tokens,
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "cached_tokens": reply.cached_tokens,
        "usage_exact": reply.usage_exact,
        "reusable_tokens": reusable,
        "ttft_s": reply.ttft_s,
        "e2e_s": reply.e2e_s,
        "decode_s": reply.decode_s,
        "tpot_s": reply.decode_s / (tokens - 1) if decoding else None,
        "decode_tokens_per_s": (tokens - 1) / reply.decode_s if decoding else None,
        "num_chunks": reply.num_chunks,
        "itl_p50_s": percentile(reply.itls, 50),
        "itl_max_s": max(reply.itls) if reply.itls else None,
    }


# -- the sweep -----------------------------------------------------------------------------------------------


@dataclass
class _LevelLog:
    """What a level's sessions share: its clock, deadline and progress bar, and where they record."""

    t0: float
    deadline: float | None
    bar: object
    records: list[dict] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0

    def add(self, record: dict, itls: list[float]) -> None:
        self.records.append(record)
        self.itls.extend(itls)
        self.output_tokens += record["completion_tokens"] or 0
        rate = self.output_tokens / (time.perf_counter() - self.t0)
        self.bar.set_postfix_str(f"{rate:.0f} out tok/s", refresh=False)
        self.bar.update(1)

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline


async def _run_session(
    client: Client, profile: ServerProfile, plan: SessionPlan, index: int, log: _LevelLog
) -> str:
    """Run one session's turns; returns why it ended: turns | duration | context_limit | error."""
    cfg, messages = plan.cfg, plan.messages
    context = plan.sizer.count("".join(m["content"] for m in messages))  # tokens the next prompt starts from
    reusable = cfg.shared_prefix_tokens
    turn_index = 0
    while cfg.max_turns is None or turn_index < cfg.max_turns:
        if log.past_deadline():
            return "duration"
        turn = plan.next_turn()
        if turn.think_s > 0:
            await asyncio.sleep(turn.think_s)
            if log.past_deadline():
                return "duration"
        need = context + turn.append_tokens + turn.reply_tokens + CONTEXT_SLACK_TOKENS
        if profile.max_model_len is not None and need > profile.max_model_len:
            return "context_limit"
        messages.append({"role": "user", "content": turn.append})
        start = time.perf_counter() - log.t0
        reply = await client.chat(messages, turn.reply_tokens)
        log.add(request_record(reply, index, turn, turn_index, start, reusable), reply.itls)
        if not reply.ok:
            return "error"
        messages.append({"role": "assistant", "content": reply.text})
        if reply.usage_exact:
            context = reusable = reply.prompt_tokens + reply.completion_tokens
        else:
            context += turn.append_tokens + (reply.completion_tokens or 0)
            reusable = 0
        turn_index += 1
    return "turns"


async def _run_level(client, profile, cfg, sizer, shared_prefix, concurrency, progress) -> dict:
    from tqdm import tqdm

    plans = [SessionPlan(cfg, sizer, shared_prefix, concurrency, i) for i in range(concurrency)]
    before = await read_cache_counters(client)
    total = None if cfg.max_turns is None else concurrency * cfg.max_turns
    with tqdm(
        total=total, desc=f"concurrency {concurrency}", unit="req", disable=not progress, file=sys.stderr
    ) as bar:
        t0, cpu0 = time.perf_counter(), time.process_time()
        log = _LevelLog(t0, None if cfg.duration_s is None else t0 + cfg.duration_s, bar)
        ends = await asyncio.gather(*(_run_session(client, profile, p, i, log) for i, p in enumerate(plans)))
        duration = time.perf_counter() - t0
        client_cpu = (time.process_time() - cpu0) / duration
    after = await read_cache_counters(client)
    records = sorted(log.records, key=lambda r: (r["session"], r["turn"]))
    summary = summarize_level(records, duration, cfg.num_gpus, log.itls)
    summary["sessions_ended"] = {why: ends.count(why) for why in sorted(set(ends))}
    summary["server_cache"] = cache_deltas(before, after, summary["reusable_prompt_tokens"])
    summary["client_cpu_util"] = client_cpu
    if client_cpu > CLIENT_CPU_WARNING:
        print(
            f"[kestrel] concurrency {concurrency}: this process used {client_cpu:.0%} of a CPU core; the client "
            "may be limiting the measurement",
            file=sys.stderr,
        )
    return {"concurrency": concurrency, "sessions": concurrency, "summary": summary, "requests": records}


async def _sweep(cfg: AgentBenchConfig, progress: bool, transport, on_level) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(cfg.concurrency) + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=timeout, transport=transport
    ) as http:
        client = Client(http, cfg)
        profile = await connect(client, cfg)
        sizer = TextSizer(profile.chars_per_token, profile.tokenizer)
        shared_source = TextSource(random.Random(f"{cfg.seed}:shared"))
        shared_prefix = sizer.cut(shared_source.tool_spec, cfg.shared_prefix_tokens)
        result = {
            "benchmark": "kestrel bench agent",
            "kestrel_version": KESTREL_VERSION,
            "command": cfg.command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": _config_json(cfg),
            "server": {k: v for k, v in vars(profile).items() if k != "tokenizer"}
            | {"base_url": cfg.base_url},
            "definitions": DEFINITIONS,
            "levels": [],
        }
        for concurrency in cfg.concurrency:
            level = await _run_level(client, profile, cfg, sizer, shared_prefix, concurrency, progress)
            result["levels"].append(level)
            if on_level is not None:
                on_level(result)
        return result


def _config_json(cfg: AgentBenchConfig) -> dict:
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    out = {k: str(v) if isinstance(v, Spread) else v for k, v in out.items()}
    return out | {"api_key": "***" if cfg.api_key else None, "max_turns": cfg.max_turns}


def run_sweep(
    cfg: AgentBenchConfig,
    progress: bool = True,
    transport=None,
    on_level: Callable[[dict], None] | None = None,
) -> dict:
    """Run the sweep; `on_level(result so far)` after each level; `transport`: an httpx transport (tests)."""
    return asyncio.run(_sweep(cfg, progress, transport, on_level))


DEFINITIONS = {
    "output_tokens_per_s": "completion tokens of the level / its wall time (first request sent to last answer)",
    "decode_tokens_per_s_per_user": "per request: (completion tokens - 1) / (last text chunk - first text chunk)",
    "p90 of a latency": "the slow tail: 90% of requests took at most this",
    "p90 of a speed": "the slow tail ('P90 interactivity'): 90% of requests decoded at least this fast",
    "ttft_s": "request sent to the first chunk carrying text",
    "itl_s": "gaps between chunks carrying text (a chunk may carry several tokens)",
    "reusable_tokens": "prompt + completion tokens of the session's previous turn (the shared prefix on turn 0)",
    "server_cache": "change of the server's hit and query token counters over the level",
    "client_cpu_util": "CPU time of the benchmark process / the level's wall time (1.0 = one core busy)",
}


# -- output --------------------------------------------------------------------------------------------------


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def plot_sweep(result: dict, path: Path) -> None:
    """Throughput per GPU against per-user decode speed, one labeled point per concurrency (P90 and median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for key, style, label in (("p90", "o-", "P90 interactivity"), ("p50", "s--", "median")):
        points = []
        for level in result["levels"]:
            s = level["summary"]
            x, y = s["decode_tokens_per_s_per_user"][key], s["output_tokens_per_s_per_gpu"]
            if x is not None and y is not None:
                points.append((x, y, level["concurrency"]))
        if not points:
            continue
        xs, ys, cs = zip(*points)
        ax.plot(xs, ys, style, label=label, alpha=1.0 if key == "p90" else 0.45)
        if key == "p90":
            for x, y, c in points:
                ax.annotate(f"{c}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    server, cfg = result["server"], result["config"]
    ax.set_xlabel("per-user decode speed (tokens/s)")
    ax.set_ylabel(f"output throughput per GPU (tokens/s, {cfg['num_gpus']} GPU)")
    ax.set_title(
        f"agent sweep: {server['model']}, {cfg['history_tokens']}-token history, "
        f"append {cfg['append_tokens']}, reply {cfg['reply_tokens']}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(title="labels: concurrency", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    """One line per level: requests, throughput, per-user speed, TTFT, E2E and the server's cache hit rate."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = (
        f"{'conc':>5} {'reqs':>5} {'fail':>4} {'out tok/s':>10} {'tok/s/GPU':>10} "
        f"{'user tok/s p50/p90':>19} {'TTFT s p50/p90':>15} {'E2E s p50/p90':>15} {'cache hit':>9}"
    )
    lines = [head, "-" * len(head)]
    for level in result["levels"]:
        s = level["summary"]
        speed, ttft, e2e = s["decode_tokens_per_s_per_user"], s["ttft_s"], s["e2e_s"]
        hit = (s["server_cache"] or {}).get("hit_rate")
        lines.append(
            f"{level['concurrency']:>5} {s['num_requests']:>5} {s['num_failed']:>4} "
            f"{f(s['output_tokens_per_s'], '.1f'):>10} {f(s['output_tokens_per_s_per_gpu'], '.1f'):>10} "
            f"{f(speed['p50'], '.1f') + ' / ' + f(speed['p90'], '.1f'):>19} "
            f"{f(ttft['p50'], '.3f') + ' / ' + f(ttft['p90'], '.3f'):>15} "
            f"{f(e2e['p50'], '.2f') + ' / ' + f(e2e['p90'], '.2f'):>15} "
            f"{f(hit, '.1%'):>9}"
        )
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------------------


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _number(kind, low: float, inclusive: bool):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        if not (value >= low if inclusive else value > low) or not math.isfinite(value):
            raise ValueError(f"expected a number {'>=' if inclusive else '>'} {low}, got {text!r}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `kestrel bench agent` (defaults from AgentBenchConfig, shown by --help)."""
    d = AgentBenchConfig()
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--concurrency",
        type=_arg(_int_list),
        default=(1, 4, 16, 64, 256),
        metavar="N,N,...",
        help="levels; each runs this many sessions (default 1,4,16,64,256)",
    )
    p.add_argument(
        "--turns",
        type=_arg(_number(int, 1, True)),
        default=None,
        help=f"turns per session (default {DEFAULT_TURNS}; unbounded with --duration-s)",
    )
    p.add_argument(
        "--duration-s",
        type=_arg(_number(float, 0, False)),
        default=None,
        help="stop starting turns this long after a level starts",
    )
    p.add_argument(
        "--history-tokens",
        type=_arg(_number(int, 1, True)),
        default=8192,
        help="system prompt + history each session opens with (default %(default)s)",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=_arg(_number(int, 0, True)),
        default=0,
        help="the start of the system prompt, shared by all sessions (default %(default)s)",
    )
    tokens = _arg(lambda t: Spread.parse(t, integer=True))
    p.add_argument(
        "--append-tokens",
        type=tokens,
        default=d.append_tokens,
        help="tool result per turn: N or LO,HI (default %(default)s)",
    )
    p.add_argument(
        "--reply-tokens",
        type=tokens,
        default=d.reply_tokens,
        help="max_tokens per turn: N or LO,HI (default %(default)s)",
    )
    p.add_argument(
        "--think-time-s",
        type=_arg(Spread.parse),
        default=d.think_time_s,
        help="pause between turns: X, LO,HI (uniform) or exp:MEAN (default %(default)s)",
    )
    p.add_argument(
        "--num-gpus",
        type=_arg(_number(int, 1, True)),
        default=1,
        help="GPUs behind the server, for tokens/s per GPU (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated sessions (default %(default)s)")
    p.add_argument(
        "--temperature", type=_arg(_number(float, 0, True)), default=0.0, help="(default %(default)s)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder to size the text exactly")
    p.add_argument(
        "--chars-per-token",
        type=_arg(_number(float, 0, False)),
        default=None,
        help="size the text by this ratio (default: measured on the server)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=_arg(_number(float, 0, False)),
        default=600.0,
        help="(default %(default)s)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="result folder (default bench/results/<date>-agent)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args) -> AgentBenchConfig:
    return AgentBenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        turns=args.turns,
        duration_s=args.duration_s,
        history_tokens=args.history_tokens,
        shared_prefix_tokens=args.shared_prefix_tokens,
        append_tokens=args.append_tokens,
        reply_tokens=args.reply_tokens,
        think_time_s=args.think_time_s,
        num_gpus=args.num_gpus,
        seed=args.seed,
        temperature=args.temperature,
        tokenizer=args.tokenizer,
        chars_per_token=args.chars_per_token,
        request_timeout_s=args.request_timeout_s,
    )


def cmd_bench_agent(args) -> int:
    cfg = config_from_args(args)
    try:
        import httpx  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise KestrelError(f"kestrel bench agent needs {e.name} (pip install {e.name})") from None
    out = args.out or Path("bench/results") / f"{datetime.date.today().isoformat()}-agent"
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)  # an unwritable folder fails here, not after the sweep
    json_path, png_path = out / "agent.json", out / "agent.png"
    try:
        result = run_sweep(cfg, progress=not args.no_progress, on_level=lambda r: write_json(r, json_path))
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    write_json(result, json_path)
    plot_sweep(result, png_path)
    print(format_table(result))
    print(f"[kestrel] wrote {json_path} and {png_path}", file=sys.stderr)
    return 0
