"""Process-group state that layers read when they shard weights. Single device by default.

Tensor-parallel (TP) and expert-parallel (EP) layouts slot in here later; today everything is rank 0 of 1,
but the weight loaders already narrow by (rank, size), so sharding needs no rewrite of the layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1


_STATE = ParallelState()


def parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> ParallelState:
    """Install a layout (returns the previous one). Models built afterwards shard their weights by it."""
    global _STATE
    if not (0 <= state.tp_rank < state.tp_size and 0 <= state.ep_rank < state.ep_size):
        raise ValueError(f"invalid parallel state {state}")
    previous, _STATE = _STATE, state
    return previous
