"""The workload's settings: `AgentBenchConfig` (validated on creation, and printable back as the command
line that reproduces it) and `Spread`, a sampled quantity such as a turn's token count or think time."""

from __future__ import annotations

import math
import random
import shlex
from dataclasses import dataclass

from kestrel.utils.errors import ConfigError

DEFAULT_TURNS = 5
DEFAULT_CHARS_PER_TOKEN = 3.5  # code-like text, when the server reports no usage to measure it from
CONTEXT_SLACK_TOKENS = 64  # chat-template tokens around the messages, kept free below the context limit
CALIBRATION_CHARS = (256, 1536)
CLIENT_CPU_WARNING = 0.8  # of one core: past this, the single-threaded client may be the bottleneck


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
                if not 0 < mean < math.inf:  # (inf sampled as expovariate(0): a ZeroDivisionError mid-sweep)
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
    # Ask for logprobs, so that every token arrives in a chunk of its own even where the server holds its text
    # back (a random-weight model's ids outside the tokenizer, partial characters): TTFT and decode speed then
    # time tokens, not text.
    token_chunks: bool = False

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
        if self.token_chunks:
            argv += ["--token-chunks"]
        return shlex.join(argv)
