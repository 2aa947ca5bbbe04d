"""How to sample a request: vLLM's `SamplingParams` for the common arguments, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = (
        1.0  # > 1 discourages tokens already in prompt or output (divides positive logits)
    )
    presence_penalty: float = 0.0  # OpenAI semantics, subtracted once per token present in the output
    frequency_penalty: float = 0.0  # OpenAI semantics, subtracted per occurrence in the output
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None  # None = a random seed drawn at admission
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob and the top k alternatives
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "n must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be >= 0 (or -1 for off)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "max_tokens must be an integer >= 1",
            ),
            (isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens must be >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be token ids",
            ),
            (
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
                "logprobs must be in [0, 20]",
            ),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
