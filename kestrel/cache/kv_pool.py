"""Paged KV for the full-attention (MLA/DSA) layers only: per token the latent row [c_kv | k_pe] and, with
DSA, the indexer key. Pages are refcounted so that the prefix cache can share them.

Tokens live in flat per-layer tensors [(num_pages + 1) * page_size, width]; token `p` of a sequence with
page table `pt` is at row `pt[p // page_size] * page_size + p % page_size`. Page 0 is a dummy that padded
rows (CUDA graphs) read and write, never handed out.
"""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig


class KVPool:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs pages >= 1 and page_size >= 1, got {num_pages} x {page_size}")
        self.page_size, self.num_pages = page_size, num_pages
        rows = (num_pages + 1) * page_size
        self.kv = {
            i: torch.zeros(rows, config.kv_cache_dim, dtype=dtype, device=device)
            for i in config.mla_layer_ids
        }
        self.index_k = (
            {
                i: torch.zeros(rows, config.index_head_dim, dtype=dtype, device=device)
                for i in config.mla_layer_ids
            }
            if config.use_dsa
            else {}
        )
        self.refcount = [0] * (num_pages + 1)
        self._free = list(range(num_pages, 0, -1))  # a stack; lowest page ids are handed out first

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        width = config.kv_cache_dim + (config.index_head_dim if config.use_dsa else 0)
        return len(config.mla_layer_ids) * width * torch.empty(0, dtype=dtype).element_size()

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

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page returns to the free list at zero."""
        for p in pages:
            assert self.refcount[p] > 0, f"double free of page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def token_rows(self, page_table: list[int], start: int, end: int) -> list[int]:
        """Flat rows of positions start..end-1 of a sequence with this page table."""
        ps = self.page_size
        return [page_table[p // ps] * ps + p % ps for p in range(start, end)]
