"""The DSA lightning indexer's projections (model-spec 2.3): its queries (from the MLA q latent, or from the hidden
states without one), per-head weights, and one normed key per token. Scoring and top-k are kestrel.ops.dsa's.

Legend: T tokens, D hidden size, HI indexer heads, DI indexer head dim.
"""

from __future__ import annotations

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

    def keys(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, DI]
        return self.k_norm(self.wk(x))

    def queries(self, x: torch.Tensor, c_q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.wq_b(c_q) if hasattr(self, "wq_b") else self.wq(x)
        q = q.view(x.shape[0], self.n_heads, self.head_dim)  # [T, HI, DI]
        w = self.weights_proj(x).float() * self.n_heads**-0.5  # [T, HI]
        return q, w
