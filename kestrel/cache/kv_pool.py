"""Paged KV for the full-attention (MLA/DSA) layers only: per token the latent row [c_kv | k_pe] and, with
DSA, the indexer key (in the pool's dtype, or FP8 E4M3 with one fp32 scale per token: `index_fp8`). Pages are
refcounted so that the prefix cache can share them.

Tokens live in flat per-layer tensors [(num_pages + 1) * page_size, width]; token `p` of a sequence with
page table `pt` is at row `pt[p // page_size] * page_size + p % page_size`. Page 0 is a dummy that padded
rows (CUDA graphs) read and write, never handed out.
"""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig
from kestrel.ops.quant import FP8, dequantize_fp8_rows, quantize_fp8_rows


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        index_fp8: bool = False,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs pages >= 1 and page_size >= 1, got {num_pages} x {page_size}")
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        rows = (num_pages + 1) * page_size
        self.kv = {
            i: torch.zeros(rows, config.kv_cache_dim, dtype=dtype, device=device)
            for i in config.mla_layer_ids
        }
        dsa = config.use_dsa
        self.index_fp8 = index_fp8 and dsa
        index_dtype = FP8 if self.index_fp8 else dtype
        self.index_k = (
            {
                i: torch.zeros(rows, config.index_head_dim, dtype=index_dtype, device=device)
                for i in config.mla_layer_ids
            }
            if dsa
            else {}
        )
        # [rows, 1] fp32 per layer: the FP8 keys' per-token scales (empty without FP8 keys)
        self.index_scale = (
            {i: torch.ones(rows, 1, dtype=torch.float32, device=device) for i in config.mla_layer_ids}
            if self.index_fp8
            else {}
        )
        self.refcount = [0] * (num_pages + 1)
        self._free = list(range(num_pages, 0, -1))  # a stack; lowest page ids are handed out first
        # pages with more than one holder: the prefix cache's pages a running request shares (only the cache's
        # pages are shared), so that the requests' pages are counted without a walk over them (`pages_in_use`)
        self.num_shared = 0

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, index_fp8: bool = False) -> int:
        elt = torch.empty(0, dtype=dtype).element_size()
        index = 0
        if config.use_dsa:
            index = config.index_head_dim + 4 if index_fp8 else config.index_head_dim * elt
        return len(config.mla_layer_ids) * (config.kv_cache_dim * elt + index)

    def write_index(self, layer_id: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Store indexer keys [n, DI] at pool rows [n] (quantized to FP8 with their scales when index_fp8)."""
        if self.index_fp8:
            q, scale = quantize_fp8_rows(keys)
            self.index_k[layer_id][rows] = q
            self.index_scale[layer_id][rows] = scale
        else:
            self.index_k[layer_id][rows] = keys.to(self.index_k[layer_id].dtype)

    def read_index(self, layer_id: int, rows: torch.Tensor) -> torch.Tensor:
        """Indexer keys at pool rows [...] -> [..., DI] in the pool's dtype (dequantized when FP8)."""
        if self.index_fp8:
            return dequantize_fp8_rows(
                self.index_k[layer_id][rows], self.index_scale[layer_id][rows], self.dtype
            )
        return self.index_k[layer_id][rows]

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages (refcount 1), or None when fewer than n are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"incref of free page {p}"
            self.refcount[p] += 1
            self.num_shared += self.refcount[p] == 2

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page returns to the free list at zero."""
        for p in pages:
            assert self.refcount[p] > 0, f"double free of page {p}"
            self.refcount[p] -= 1
            self.num_shared -= self.refcount[p] == 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def pages_in_use(self, cached_pages: int) -> int:
        """Pages the requests hold (alone or with the prefix cache), given the `cached_pages` the cache holds: those
        it holds alone it gives back on demand, so they are not in use."""
        return self.num_pages - self.num_free_pages - (cached_pages - self.num_shared)

    def token_rows(self, page_table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat rows [end - start] int64 (on the CPU) of positions start..end-1 of a sequence with this page
        table; vectorized, since a long prompt has tens of thousands of positions."""
        ps = self.page_size
        first, last = start // ps, -(-end // ps)  # the pages that hold the span
        assert last <= len(page_table), (
            f"positions up to {end} need {last} pages, the table has {len(page_table)}"
        )
        pages = torch.tensor(page_table[first:last], dtype=torch.int64)  # [n]
        rows = (pages[:, None] * ps + torch.arange(ps)).flatten()  # [n * ps]
        return rows[start - first * ps : end - first * ps]
