"""Norm modules over kestrel.ops.norm."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.linear import set_loader
from kestrel.ops.norm import layer_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = set_loader(nn.Parameter(torch.ones(dim, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = set_loader(nn.Parameter(torch.ones(dim, dtype=dtype)))
        self.bias = set_loader(nn.Parameter(torch.zeros(dim, dtype=dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
