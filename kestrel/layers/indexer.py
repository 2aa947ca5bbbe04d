"""The DSA lightning indexer's projections (model-spec 2.3): its queries (from the MLA q latent, or from the hidden
states without one), per-head weights, and one normed key per token; and the scores of training's row-packed
tokens (the sparse selection's and the KL's). Inference's scoring and the top-k are kestrel.ops.dsa's.

Legend: T tokens, D hidden size, HI indexer heads, DI indexer head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.layers.linear import Linear
from kestrel.layers.norm import LayerNorm

# DeepSeek's MLA and indexer norms use a fixed eps (transformers and the reference code agree).
LATENT_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """DSA lightning indexer (model-spec 2.3), NoPE: I[t, s] = sum_j w[t, j] relu(q[t, j] . k[s]) / sqrt(DI)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.scale = self.head_dim**-0.5  # of the q . k dot products
        self.weight_scale = self.n_heads**-0.5  # of the head weights
        self.config_topk = config.index_topk  # `topk` may be switched off (None = dense) and back
        q_in = config.q_lora_rank or config.hidden_size  # reads the MLA q latent when there is one
        q_out = self.n_heads * self.head_dim
        if config.q_lora_rank:
            self.wq_b = Linear(q_in, q_out, dtype=dtype)
        else:
            self.wq = Linear(q_in, q_out, dtype=dtype)
        self.wk = Linear(config.hidden_size, self.head_dim, dtype=dtype)
        self.k_norm = LayerNorm(self.head_dim, LATENT_NORM_EPS, dtype=dtype)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, dtype=dtype)

    def from_x(self, x: torch.Tensor) -> list[tuple[torch.Tensor, Linear]]:
        """The projections of the hidden states x [T, D], as (input, layer) pairs for `apply_many`: the queries'
        (without a q latent), the key's, the head weights'. The caller runs them beside its own."""
        return [*([(x, self.wq)] if hasattr(self, "wq") else []), (x, self.wk), (x, self.weights_proj)]

    def from_q_latent(self, c_q: torch.Tensor | None) -> list[tuple[torch.Tensor, Linear]]:
        """The queries' projection of the MLA q latent c_q [T, Rq], where the model has one."""
        return [(c_q, self.wq_b)] if hasattr(self, "wq_b") else []

    def finish(
        self, q_raw: torch.Tensor, k_raw: torch.Tensor, w_raw: torch.Tensor, decode: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections' outputs [T, HI * DI], [T, DI], [T, HI] -> the new keys [T, DI] (normed), the queries
        [T, HI, DI] and the head weights [T, HI] (fp32 times `weight_scale`). At decode the keys and the weights
        stay as projected: the cache write norms the keys (`key_norm`) and the scores kernel scales the weights as
        it reads them, each in a launch it makes anyway (four launches a layer fewer)."""
        q = q_raw.view(q_raw.shape[0], self.n_heads, self.head_dim)
        if decode:
            return k_raw, q, w_raw
        return self.k_norm(k_raw), q, self.head_weights(w_raw)

    def key_norm(self) -> tuple:
        """The keys' LayerNorm as the cache write takes it: (weight, bias, eps)."""
        return self.k_norm.weight, self.k_norm.bias, self.k_norm.eps

    def head_weights(self, w_raw: torch.Tensor) -> torch.Tensor:
        """The head weights as the scores take them: [T, HI] fp32 times `weight_scale`."""
        return w_raw.float() * self.weight_scale

    def row_scores_triton(
        self, q_i, w_i, k_i, picks: torch.Tensor, starts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`row_scores` of one row's queries `picks` through the prefill indexer kernel (the one inference
        scores with): the row's keys read once per block of queries, the heads summed on chip, NaN past each
        query's position and, with `starts` [M], before starts[m] (a block's key tiles outside [its least start, its
        greatest position] are not computed).
        q_i [R, HI, DI], w_i [R, HI], k_i [R, DI] -> [M, R] fp32. In place of the reference's
        per-head fp32 GEMM and three passes over [M, R] (about 3 ms a row of 8704 tokens of the demo model on
        the H200, most of sparse training's extra 60 ms a step, session 10's estimate)."""
        from kestrel.ops.dsa.triton_scores import indexer_scores_prefill_triton

        R = k_i.shape[0]
        page = math.gcd(R, 64)  # the row's keys as pages of the kernel's paged layout, in order
        pages = torch.arange(R // page, device=k_i.device)
        # 64 x 64 tiles, as the shipped demo trained with: the 64 x 128 default was timed on inference's bf16
        # scores only (fp32 queries at mini's sizes would not fit its 3 stages in shared memory)
        return indexer_scores_prefill_triton(
            q_i[picks], k_i.contiguous(), pages, picks + 1, w_i[picks], self.scale, page_size=page,
            block_s=64, starts=starts,
        )  # fmt: skip

    def row_scores(self, q_i, w_i, k_i, picks: torch.Tensor | None = None) -> torch.Tensor:
        """Indexer scores of row-packed tokens, one head at a time (no [B, R, HI, R] intermediate):
        q_i [B, R, HI, DI], w_i [B, R, HI], k_i [B, R, DI] -> [B, Q, R] fp32 for the queries `picks` (all: Q = R)."""
        if picks is not None:
            q_i, w_i = q_i[:, picks], w_i[:, picks]
        k = k_i.float().transpose(1, 2)  # [B, DI, R]
        out = None
        for j in range(q_i.shape[2]):
            term = torch.bmm(q_i[:, :, j].float(), k).relu() * w_i[:, :, j, None].float()  # [B, Q, R]
            out = term if out is None else out + term
        return out * self.scale

    def picked_scores(self, q_i, w_i, k_i, picks: torch.Tensor) -> torch.Tensor:
        """`row_scores` of a few queries a row (the KL's samples: Q = 64 of 8704 on mini), every head in
        one matmul: [B, Q, HI, R] is small at such Q, and the per-head loop cost ~20 launches a head forward and
        backward (mini, 3 rows, session 30: 9,854 -> 7,682 launches a dense step; the host's time, it set the pace).
        q_i [B, R, HI, DI], w_i [B, R, HI], k_i [B, R, DI] -> [B, Q, R] fp32."""
        q = q_i[:, picks].float()  # [B, Q, HI, DI]
        B, Q, HI, DI = q.shape
        logits = torch.bmm(q.reshape(B, Q * HI, DI), k_i.float().transpose(1, 2)).relu()  # [B, Q * HI, R]
        heads = logits.view(B, Q, HI, -1) * w_i[:, picks].float()[..., None]  # [B, Q, HI, R] fp32
        return heads.sum(2) * self.scale
