"""The engine's per-step `CacheView` over the paged KV pool and the state slots (see
kestrel.layers.context.CacheView). Built by the runner from device tensors only, so that a decode step
through it can be captured in a CUDA graph: the runner refills the same tensors before each replay."""

from __future__ import annotations

import torch

from kestrel.cache.kv_pool import KVPool
from kestrel.cache.state_pool import StatePool
from kestrel.ops.mla.naive import WriteNorms, write_rows
from kestrel.ops.norm import layer_norm
from kestrel.ops.quant import dequantize_fp8_rows


class KDASaves:
    """KDA states to save at positions inside a prefill chunk, in the same forward: each save is one more
    varlen segment, a copy of the first `length` new tokens of batch sequence `seq`, starting from that
    sequence's initial state; its final state is the state at the save's position.
    Built from the batch's cu_seqlens [N + 1] and the saves, (seq, length, checkpoint slot of `pool`) each:
    seqs [X] (batch index of each save), rows [sum of lengths] (packed-token rows the segments copy, in order),
    cu_seqlens [N + X + 1] (the batch's sequences, then the saves), slots [X]."""

    def __init__(self, pool: StatePool, cu_seqlens: list[int], saves: list[tuple[int, int, int]], device):
        seqs, lengths, slots = (list(column) for column in zip(*saves))
        self.pool = pool
        self.seqs = torch.tensor(seqs, device=device)
        rows = [torch.arange(cu_seqlens[i], cu_seqlens[i] + n) for i, n, _ in saves]
        self.rows = torch.cat(rows).to(device)
        tail = torch.tensor(lengths).cumsum(0) + cu_seqlens[-1]
        self.cu_seqlens = torch.cat([torch.tensor(cu_seqlens), tail]).to(device)
        self.slots = torch.tensor(slots, device=device)


class PagedCacheView:
    """slots [N] state slots; write_rows [T] pool rows of the new tokens (packed order);
    page_table [N, maxp] (padded with page 0) and lens [N] (tokens cached after this step) for batched
    reads; ends: lens on the host, for the per-sequence (reference) reads, whose rows of positions 0..L-1 are
    built on the device at a sequence's first read (the fast paths read the pages and never build them)."""

    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        slots: torch.Tensor,
        write_rows: torch.Tensor,
        page_table: torch.Tensor | None = None,
        lens: torch.Tensor | None = None,
        ends: list[int] | None = None,
    ):
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.slots, self.write_rows = slots, write_rows
        self.page_table, self.lens, self.ends = page_table, lens, ends
        self._read_rows: dict[int, torch.Tensor] = {}
        self.saves: KDASaves | None = None

    def kda_saves(self) -> KDASaves | None:
        """Mid-chunk KDA checkpoints of this prefill step (None: none)."""
        return self.saves

    def save_kda_checkpoints(self, layer_id: int, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        """The final states of the `kda_saves` segments [X, ...] into their checkpoint slots."""
        _store_states(self.saves.pool, layer_id, self.saves.slots, ssm, conv)

    def kda_pools(self, layer_id: int):
        """(recurrent-state pool [S, H, K, V], conv-window pool [S, C, W - 1], slots [N]): decode updates the
        slots in place instead of gathering and scattering whole states."""
        return self.state_pool.ssm[layer_id], self.state_pool.conv[layer_id], self.slots

    def kda_state(self, layer_id: int):
        return self.state_pool.ssm[layer_id][self.slots], self.state_pool.conv[layer_id][self.slots]

    def set_kda_state(self, layer_id: int, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        _store_states(self.state_pool, layer_id, self.slots, ssm, conv)

    def write_kv(
        self, layer_id: int, parts: tuple, index_k: torch.Tensor | None, norms: WriteNorms | None = None
    ) -> None:
        """The protocol's `write_kv`: on the fast path the write kernel applies `norms` to each row as it stores it."""
        kv_norm, index_norm = norms or (None, None)
        pool = self.kv_pool
        if index_k is None or pool.index_fp8:  # FP8 keys are quantized with their scales apart
            write_rows(pool.kv[layer_id], self.write_rows, parts, kv_norm=kv_norm)
            if index_k is not None:
                if index_norm is not None:
                    index_k = layer_norm(index_k, *index_norm)
                pool.write_index(layer_id, self.write_rows, index_k)
        else:  # one launch for both pools (and the norms) on the fast path
            write_rows(
                pool.kv[layer_id],
                self.write_rows,
                parts,
                pool.index_k[layer_id],
                index_k,
                kv_norm,
                index_norm,
            )

    def read_rows(self, seq: int) -> torch.Tensor:
        """Pool rows [L] of sequence seq's positions 0..L-1 (L = ends[seq]), from its page-table row."""
        if seq not in self._read_rows:
            ps, L = self.kv_pool.page_size, self.ends[seq]
            pages = self.page_table[seq, : -(-L // ps), None]  # [n, 1]
            self._read_rows[seq] = (pages * ps + torch.arange(ps, device=pages.device)).flatten()[:L]
        return self._read_rows[seq]

    def read_kv(self, layer_id: int, seq: int, index: bool = True):
        rows = self.read_rows(seq)
        index_k = self.kv_pool.read_index(layer_id, rows) if self.kv_pool.index_k and index else None
        return self.kv_pool.kv[layer_id][rows], index_k

    def read_kv_run(self, layer_id: int, first: int, count: int, length: int) -> torch.Tensor:
        """Latent KV [count, length, R + P] of sequences first .. first + count - 1, positions 0..length-1 of
        each (no indexer keys), in one gather from their page-table rows."""
        ps = self.kv_pool.page_size
        pool = self.kv_pool.kv[layer_id]
        paged = pool.view(-1, ps, pool.shape[-1])  # [pages + 1, page, R + P]
        pages = self.page_table[first : first + count, : -(-length // ps)]  # [count, n]
        return paged[pages].reshape(count, -1, pool.shape[-1])[:, :length]

    def read_kv_batched(self, layer_id: int):
        """(kv [N, maxp * page, R + P], index keys [N, maxp * page, DI] or None, lens [N]); rows past lens[i]
        are padding (another sequence's or the dummy page's data) that the attention masks out."""
        N, maxp = self.page_table.shape
        ps = self.kv_pool.page_size

        def gather(pool: torch.Tensor) -> torch.Tensor:
            paged = pool.view(-1, ps, pool.shape[-1])  # [pages + 1, page, W]
            return paged[self.page_table].reshape(N, maxp * ps, pool.shape[-1])  # [N, maxp * page, W]

        index_k = None
        if self.kv_pool.index_k:
            index_k = gather(self.kv_pool.index_k[layer_id])
            if self.kv_pool.index_fp8:
                scale = gather(self.kv_pool.index_scale[layer_id])
                index_k = dequantize_fp8_rows(index_k, scale, self.kv_pool.dtype)
        return gather(self.kv_pool.kv[layer_id]), index_k, self.lens

    def index_scales(self, layer_id: int) -> torch.Tensor | None:
        """The per-token scales [rows, 1] fp32 of FP8 indexer keys, or None when the keys are not FP8."""
        return self.kv_pool.index_scale.get(layer_id)

    def paged(self, layer_id: int):
        """The pool tensors and page table themselves, for kernels that read the pages directly:
        (kv pool [rows, R + P], indexer-key pool [rows, DI] or None (FP8 with `index_scales`), page_table
        [N, maxp], lens [N], page_size)."""
        index_k = self.kv_pool.index_k.get(layer_id) if self.kv_pool.index_k else None
        return self.kv_pool.kv[layer_id], index_k, self.page_table, self.lens, self.kv_pool.page_size


def _store_states(pool: StatePool, layer_id: int, slots: torch.Tensor, ssm: torch.Tensor, conv: torch.Tensor):
    """One layer's KDA states into `pool` at `slots`: recurrent states in fp32, conv windows in the pool's dtype."""
    pool.ssm[layer_id][slots] = ssm.float()
    pool.conv[layer_id][slots] = conv.to(pool.conv[layer_id].dtype)
