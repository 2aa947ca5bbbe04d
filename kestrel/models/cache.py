"""The reference per-request cache: dense tensors, one row per request. Slow and obvious on purpose;
the engine's paged pools implement the same `CacheView` and are tested against it.

Per request: per KDA layer the recurrent state [H, K, V] (fp32) and conv window [3P, W-1]; per MLA layer the
latent rows [max_len, R + Pr] and, with DSA, the indexer keys [max_len, DI].
"""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig
from kestrel.layers.context import ForwardContext
from kestrel.ops.mla.naive import WriteNorms, write_norms


class DenseCache:
    def __init__(
        self,
        config: ModelConfig,
        num_requests: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.config, self.max_len = config, max_len
        self.lens = [0] * num_requests
        H, K, P, W = config.kda_num_heads, config.kda_head_dim, config.kda_proj_dim, config.kda_conv_size
        self.ssm = {
            i: torch.zeros(num_requests, H, K, K, dtype=torch.float32, device=device)
            for i in config.kda_layer_ids
        }
        self.conv = {
            i: torch.zeros(num_requests, 3 * P, W - 1, dtype=dtype, device=device)
            for i in config.kda_layer_ids
        }
        self.kv = {
            i: torch.zeros(num_requests, max_len, config.kv_cache_dim, dtype=dtype, device=device)
            for i in config.mla_layer_ids
        }
        self.index_k = (
            {
                i: torch.zeros(num_requests, max_len, config.index_head_dim, dtype=dtype, device=device)
                for i in config.mla_layer_ids
            }
            if config.use_dsa
            else {}
        )

    def context(self, requests: list[int], new_lens: list[int], device=None) -> ForwardContext:
        """The ForwardContext of one step in which `requests` (row ids) bring `new_lens` new tokens each."""
        prefix = [self.lens[r] for r in requests]
        for r, p, n in zip(requests, prefix, new_lens):
            if p + n > self.max_len:
                raise ValueError(f"request {r}: {p + n} tokens exceed the cache's max_len={self.max_len}")
        view = _DenseView(self, requests, prefix, new_lens)
        return ForwardContext.build(new_lens, prefix, view, device or self.conv_device)

    def commit(self, ctx: ForwardContext) -> None:
        """Advance the lengths after a forward pass that used `ctx`."""
        for r, n in zip(ctx.cache.requests, ctx.new_lens):
            self.lens[r] += n

    @property
    def conv_device(self):
        tensors = list(self.conv.values()) + list(self.kv.values())
        return tensors[0].device


class _DenseView:
    def __init__(self, cache: DenseCache, requests: list[int], prefix: list[int], new: list[int]):
        self.cache, self.requests, self.prefix, self.new = cache, requests, prefix, new
        self.rows = torch.tensor(requests, device=cache.conv_device)

    def kda_pools(self, layer_id: int):
        return self.cache.ssm[layer_id], self.cache.conv[layer_id], self.rows

    def kda_state(self, layer_id: int):
        return self.cache.ssm[layer_id][self.rows], self.cache.conv[layer_id][self.rows]

    def kda_saves(self):
        return None  # the dense cache keeps no checkpoints

    def set_kda_state(self, layer_id: int, ssm: torch.Tensor, conv: torch.Tensor) -> None:
        self.cache.ssm[layer_id][self.rows] = ssm.float()
        self.cache.conv[layer_id][self.rows] = conv.to(self.cache.conv[layer_id].dtype)

    def write_kv(
        self, layer_id: int, parts: tuple, index_k: torch.Tensor | None, norms: WriteNorms | None = None
    ) -> None:
        parts, index_k = write_norms(parts, index_k, *(norms or ()))
        kv = torch.cat(parts, dim=-1)  # [T, R + P]
        start = 0
        for r, p, n in zip(self.requests, self.prefix, self.new):
            self.cache.kv[layer_id][r, p : p + n] = kv[start : start + n]
            if index_k is not None:
                self.cache.index_k[layer_id][r, p : p + n] = index_k[start : start + n]
            start += n

    def read_kv_batched(self, layer_id: int):
        lens = torch.tensor([p + n for p, n in zip(self.prefix, self.new)], device=self.rows.device)
        index_k = self.cache.index_k[layer_id][self.rows] if self.cache.index_k else None
        return self.cache.kv[layer_id][self.rows], index_k, lens

    def read_kv(self, layer_id: int, seq: int, index: bool = True):
        r, length = self.requests[seq], self.prefix[seq] + self.new[seq]
        index_k = self.cache.index_k[layer_id][r, :length] if self.cache.index_k and index else None
        return self.cache.kv[layer_id][r, :length], index_k
