"""The procedural workload, deterministic from the seed: agent-session text (tool outputs, code, logs,
assistant prose), cut to token counts by a `TextSizer`, and each session's script (`SessionPlan`): its
opening history and the tool result, reply length and think time of every turn."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kestrel.bench.agent.config import AgentBenchConfig

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
