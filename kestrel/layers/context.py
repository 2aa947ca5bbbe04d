"""Per-batch metadata that reaches the layers without passing through forward signatures.

The runner (or the reference `generate()`) builds one `ForwardContext` per forward pass and enters
`forward_context(ctx)`; layers read it with `get_forward_context()`. Tokens of all sequences are packed
into one varlen batch: sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1], at absolute positions
prefix_lens[i] .. prefix_lens[i] + new_lens[i] - 1.

`cache` is the per-step view of whatever holds the per-request state (the dense reference cache of
`kestrel.models.cache`, or the engine's paged pools). It implements `CacheView`. With `cache=None` the
forward is stateless: every sequence starts from position 0 with zero KDA state (training, full forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kestrel.utils.device import to_device_async

if TYPE_CHECKING:
    from kestrel.ops.mla.naive import WriteNorms


class CacheView(Protocol):
    """The per-request state of the sequences in one batch, in batch order."""

    def kda_state(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent state [N, H, K, V] fp32, conv window [N, C, W - 1]) entering this batch."""
        ...

    def set_kda_state(self, layer_id: int, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        """Store the states after this batch (same shapes as `kda_state`)."""
        ...

    def kda_saves(self):
        """KDA states to save at positions inside this prefill step's chunks (kestrel.cache.view.KDASaves:
        segment rows, cu_seqlens with the save segments after the batch's, target slots), or None."""
        ...

    def save_kda_checkpoints(self, layer_id: int, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        """The final states [X, ...] of `kda_saves`' segments, into their checkpoint slots."""
        ...

    def kda_pools(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(recurrent-state pool [S, H, K, V], conv-window pool [S, C, W - 1], slots [N] of this batch's
        sequences): the decode path advances the states in place."""
        ...

    def write_kv(
        self, layer_id: int, parts: tuple, index_k: torch.Tensor | None, norms: WriteNorms | None = None
    ) -> None:
        """Store the latent KV of this batch's new tokens, given as its parts (c_kv [T, R], k_pe [T, P]: a row is
        them side by side), and their indexer keys [T, DI]. With `norms` (decode) c_kv and the keys come before
        their norms, which the write applies (`kestrel.ops.mla.naive.write_rows`)."""
        ...

    def read_kv(
        self, layer_id: int, seq: int, index: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latent KV [L, R + P] and indexer keys [L, DI] of sequence `seq`, positions 0..L-1, new tokens
        included (L = prefix_lens[seq] + new_lens[seq]); the keys None without `index` (dense attention reads
        none)."""
        ...

    def read_kv_run(self, layer_id: int, first: int, count: int, length: int) -> torch.Tensor:
        """Latent KV [count, length, R + P] of sequences first .. first + count - 1, positions 0..length-1 of
        each: the dense prefill's runs of fresh sequences of one length. Paged caches only (the runs are taken
        on the paged fast path)."""
        ...

    def read_kv_batched(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Every sequence at once, padded: (kv [N, Lmax, R + P], index keys [N, Lmax, DI] or None,
        lens [N] device int64). Rows at or past lens[i] are padding. Used by the decode path (no host syncs)."""
        ...


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] int64 absolute positions
    cu_seqlens: torch.Tensor  # [N + 1] int64, new tokens per sequence, packed
    new_lens: list[int]  # [N] new tokens per sequence (host copy)
    prefix_lens: list[int]  # [N] tokens already cached per sequence (host copy)
    cache: CacheView | None = None
    # One new token per sequence, read through `cache.read_kv_batched`: the batched, host-sync-free path
    # that decode steps (and their CUDA graphs) take. Set by whoever builds the context.
    decode: bool = False
    # Training layout: the T tokens are T / row_len rows of equal length and no document crosses a row, so
    # attention runs per row with a document-causal mask (kestrel.layers.mla._attend_rows).
    row_len: int | None = None
    # Routing capture/replay (RL, and fast-vs-reference checks): MoE layers record their expert ids [T, A]
    # into `routing_capture` (layer_id -> ids) when it is a dict, and use `routing_replay` ids instead of
    # selecting when it is one.
    routing_capture: dict | None = None
    routing_replay: dict | None = None
    # The same for DSA selections: layer_id -> [indices [t_i, k] of each sequence, in batch order].
    selection_capture: dict | None = None
    selection_replay: dict | None = None
    extras: dict = field(default_factory=dict)
    # host_positions()' cache: not an init field, so dataclasses.replace() recomputes it from the new layout
    _host_positions: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _host_cu_seqlens: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    def cached_len(self, i: int) -> int:
        """Tokens of sequence i in the cache once this step has written its new ones."""
        return self.prefix_lens[i] + self.new_lens[i]

    def host_positions(self) -> torch.Tensor:
        """The positions computed on the CPU from the host copies of the layout (prefix_lens, new_lens), equal
        to `positions` for a context built by `build`: what a layer reads to decide on the host (which tokens
        to work on) without a device sync. Built once. Not for decode contexts, whose host layout the runner
        leaves as placeholders (their positions live on the device only)."""
        if self.decode:
            raise RuntimeError("a decode context keeps its positions on the device only")
        if self._host_positions is None:
            self._host_positions = _layout_positions(self.prefix_lens, self.new_lens)
        return self._host_positions

    def host_cu_seqlens(self) -> torch.Tensor:
        """`cu_seqlens` computed on the CPU from `new_lens` (int64 [N + 1]): what fla-core's varlen kernels read
        to index their chunks, which they would otherwise copy back from the device. Built once; not for decode
        contexts (see host_positions)."""
        if self.decode:
            raise RuntimeError("a decode context keeps its layout on the device only")
        if self._host_cu_seqlens is None:
            self._host_cu_seqlens = _layout_offsets(self.new_lens)
        return self._host_cu_seqlens

    def seq_slice(self, i: int) -> slice:
        start = sum(self.new_lens[:i])
        return slice(start, start + self.new_lens[i])

    @staticmethod
    def build(
        new_lens: list[int],
        prefix_lens: list[int] | None = None,
        cache: CacheView | None = None,
        device: torch.device | str = "cpu",
    ) -> ForwardContext:
        prefix_lens = list(prefix_lens) if prefix_lens is not None else [0] * len(new_lens)
        if len(prefix_lens) != len(new_lens) or any(n < 1 for n in new_lens):
            raise ValueError(f"bad batch layout: new_lens={new_lens} prefix_lens={prefix_lens}")
        positions, cu = _layout_positions(prefix_lens, new_lens), _layout_offsets(new_lens)
        decode = cache is not None and all(n == 1 for n in new_lens)
        ctx = ForwardContext(
            to_device_async(positions, device),
            to_device_async(cu, device),
            list(new_lens),
            prefix_lens,
            cache,
            decode,
        )
        ctx._host_positions, ctx._host_cu_seqlens = positions, cu
        return ctx


def _layout_offsets(new_lens: list[int]) -> torch.Tensor:
    """[N + 1] int64 on the CPU: where each sequence's new tokens start in the packed batch, then the total."""
    cu = torch.zeros(len(new_lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(new_lens).cumsum(0)
    return cu


def _layout_positions(prefix_lens: list[int], new_lens: list[int]) -> torch.Tensor:
    """[sum(new_lens)] int64 on the CPU: sequence i's new tokens at prefix_lens[i] .. + new_lens[i] - 1."""
    return torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, new_lens)])


_ACTIVE: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("forward_context does not nest: a forward pass is already in progress")
    _ACTIVE = ctx
    try:
        yield ctx
    finally:
        _ACTIVE = None


def get_forward_context() -> ForwardContext:
    if _ACTIVE is None:
        raise RuntimeError("no forward context: run the model inside `with forward_context(ctx):`")
    return _ACTIVE


def has_forward_context() -> bool:
    return _ACTIVE is not None
