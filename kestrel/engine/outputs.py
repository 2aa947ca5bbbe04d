"""What the engine reports: per step, the new tokens of each request (`StepOutput`); at the end of the offline
API, vLLM-shaped `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a position's logprobs, as vLLM's: its logprob, its rank in the model's distribution
    (1 is the most likely; None where it is not among the top-k asked for), and its text (offline outputs)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprob(Mapping):
    """A position's logprobs: the token taken there and the top-k alternatives. Also a mapping token id ->
    `Logprob`, the taken token first then the top-k best first, so that vLLM's offline code
    (`out.outputs[0].logprobs[i][token_id].logprob`, `.items()`) reads it as it reads vLLM's dicts."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k alternatives (token id, logprob), best first

    # the mapping (dict[int, Logprob]), made on first use; unannotated, so not a field: outside the value,
    # asdict and replace
    _made = None

    def set_texts(self, texts: dict[int, str]) -> None:
        """Each token's text (vLLM's `decoded_token`), where the offline API decoded them (`LLM.generate`)."""
        self._made = self._make(texts)

    def _entries(self) -> dict[int, Logprob]:
        if self._made is None:
            self._made = self._make({})
        return self._made

    def _make(self, texts: dict[int, str]) -> dict[int, Logprob]:
        ranks = {t: r for r, (t, _) in enumerate(self.top, 1)}
        entries = {self.token_id: Logprob(self.logprob, ranks.get(self.token_id), texts.get(self.token_id))}
        for t, v in self.top:
            entries.setdefault(t, Logprob(v, ranks[t], texts.get(t)))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


@dataclass
class StepOutput:
    """New tokens of one request in one engine step. `finished` with `finish_reason` in
    {'stop', 'length', 'abort'}; `stop_reason` is the matched stop string or stop token id (None for EOS)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    # with prompt_logprobs, on the output of the request's first token: each prompt token's (None first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave the request (none computed for them)
    queue_time: float | None = None  # seconds from its arrival to its first admission (None before that)
    scheduled_time: float | None = None  # when it was first admitted (time.monotonic; None before that)

    @property
    def stopped_by_token(self) -> bool:
        """Whether this ends its request at a stop token (EOS, or one of stop_token_ids): its last token."""
        return self.finished and self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs where they were asked for (vLLM's field), else None."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with prompt_logprobs (vLLM's: None first)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave (its first sample's), as vLLM's
