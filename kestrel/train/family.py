"""What every task family of the demo model builds on: `Example` (a rendered problem), `Draft` (a drawn one),
`Family` (draw from a derived seed, keep the problem on its seed's side of the split, render it), and the seeds.

Held-out split: seeds at or above `HELDOUT_SEED_OFFSET` are the held-out namespace. Small problem spaces
(a 3-term 1-digit chain sum) would repeat across any two seed ranges, so a problem's identity (its `key`, e.g.
the expression) is also hashed into one of `HELDOUT_BUCKETS` buckets: held-out seeds only produce problems of
bucket 0, train seeds never do. Train and held-out prompts are therefore disjoint at any sample size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

HELDOUT_SEED_OFFSET = 10**9
HELDOUT_BUCKETS = 8
_MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    reasoning: str  # worked steps, without the final answer line
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-serializable; holds what `verify` needs
    # A tail of `prompt` that training also predicts (the retrieval question: its name must be copied from the
    # facts, the skill the answer needs); "" trains on the assistant turn only.
    trained_prompt_tail: str = ""

    def __post_init__(self):
        if not self.prompt.endswith(self.trained_prompt_tail):
            raise ValueError(f"trained_prompt_tail {self.trained_prompt_tail!r} is not a tail of the prompt")


@dataclass(frozen=True)
class Draft:
    """A drawn problem before rendering; `key` is its identity for the train / held-out partition."""

    key: str
    data: dict[str, Any]


def is_heldout_seed(seed: int) -> bool:
    if seed < 0:
        raise ValueError(f"seeds are non-negative, got {seed}")
    return seed >= HELDOUT_SEED_OFFSET


def derive_seed(*parts) -> int:
    """A 64-bit seed from any reprable parts, stable across processes (unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _in_heldout_bucket(key: str) -> bool:
    return derive_seed("split", key) % HELDOUT_BUCKETS == 0


class Family:
    """A task family: draw a problem from a derived seed, keep it if it falls on the seed's side of the split,
    render its prompt, steps and answer."""

    name: ClassVar[str]
    LEVELS: ClassVar[dict[str, dict[str, Any]]]
    DEFAULT_LEVEL: ClassVar[str]

    def __init__(self, level: str | None = None):
        self.level = level or self.DEFAULT_LEVEL
        if self.level not in self.LEVELS:
            raise ValueError(f"{self.name}: unknown level {self.level!r}; choose from {sorted(self.LEVELS)}")
        self.settings = self.LEVELS[self.level]

    def generate(self, seed: int, index: int, **kwargs) -> Example:
        heldout = is_heldout_seed(seed)
        for attempt in range(_MAX_ATTEMPTS):
            draft = self._draw(derive_seed(self.name, seed, index, attempt))
            if draft is not None and _in_heldout_bucket(draft.key) == heldout:
                return self._finish(draft, **kwargs)
        raise RuntimeError(f"{self.name}: no problem found for seed {seed}, index {index}")

    def _draw(self, sub_seed: int) -> Draft | None:
        """A problem, or None when the level's filter rejects it."""
        raise NotImplementedError

    def _finish(self, draft: Draft, **kwargs) -> Example:
        raise NotImplementedError

    def check(self, meta: dict, answer: str) -> bool:
        raise NotImplementedError

    def _example(
        self, prompt: str, reasoning: str, answer: str, trained_prompt_tail: str = "", **meta
    ) -> Example:
        meta = {"family": self.name, "level": self.level, "answer": answer, **meta}
        return Example(self.name, prompt, reasoning, answer, meta, trained_prompt_tail)
