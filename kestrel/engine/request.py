"""One request's life in the engine: tokens, resources (a state slot and KV pages), progress and outcome."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kestrel.engine.outputs import TokenLogprob
from kestrel.engine.sampling_params import SamplingParams
from kestrel.grammar.tokens import Grammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_total_tokens: int  # prompt + output may not exceed this (max_tokens and the context limit)
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with params.prompt_logprobs: each prompt token's given the ones before it, as far as computed (None first)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None  # KDA state slot
    pages: list[int] = field(default_factory=list)  # KV pages, in position order
    num_computed: int = 0  # tokens whose KV and state are in the cache
    # prompt tokens the prefix cache gave it when it was first admitted (vLLM's num_cached_tokens); None before
    num_cached_tokens: int | None = None
    first_scheduled_time: float | None = None  # when it was first admitted (time.monotonic): its queue time
    # a running request prefilling this one's prompt, and the position of the checkpoint it waits for (Scheduler)
    follows: tuple[Request, int] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Prefix cache: the locked tree node this request resumed from, the checkpoint slot to restore before its
    # first chunk, the positions where its prefill saves KDA checkpoints (a chunk ends at the interval ones;
    # the others are saved inside their chunk), and the decode-time tracking slot holding the state at the
    # last page boundary (`track_len` tokens).
    cache_node: object | None = None
    restore_from: int | None = None
    checkpoint_at: list[int] = field(default_factory=list)
    track_slot: int | None = None
    track_len: int = 0
    # structured outputs: the grammar its output follows and the grammar's state after the outputs so far
    grammar: Grammar | None = None
    grammar_state: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asks for prompt logprobs not all computed yet: its prompt runs whole, none of it from the cache."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def in_decode(self) -> bool:
        """All tokens but the last sampled one are cached: the next step computes exactly one token."""
        return (
            self.status is Status.RUNNING
            and self.num_computed == self.num_tokens - 1
            and bool(self.output_ids)
        )

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
