"""Sampling ops: `naive` (logits processing, seeded sampling, greedy), and `argmax` for greedy rows."""

from __future__ import annotations

import torch

from kestrel.ops.sampling.naive import greedy


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of logits [B, V] -> [B] int64, `naive.greedy`'s (the first maximum): through the Triton
    kernels of `triton_argmax` on CUDA (one graph node pair, no torch reduction), else torch."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        from kestrel.ops.sampling.triton_argmax import argmax_triton

        return argmax_triton(logits)
    return greedy(logits)


__all__ = ["argmax", "greedy"]
