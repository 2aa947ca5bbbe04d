"""Sampling ops: `naive` (logits processing, seeded sampling, greedy), `argmax` for greedy rows and
`token_logprobs` for the logprobs requests ask for."""

from __future__ import annotations

import torch

from kestrel.ops.sampling import naive
from kestrel.ops.sampling.naive import greedy


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of logits [B, V] -> [B] int64, `naive.greedy`'s (the first maximum): through the Triton
    kernels of `triton_argmax` on CUDA (one graph node pair, no torch reduction), else torch."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0:
        from kestrel.ops.sampling.triton_argmax import argmax_triton

        return argmax_triton(logits)
    return greedy(logits)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprobs of the rows `rows` (int64 on the logits' device; None: all) of logits [B, V]: each one's
    sampled token's (tokens [B]) [b] fp32, and its top k values [b, k] fp32 and ids [b, k] int64, as
    `naive.token_logprobs` on those rows: through the Triton kernels of `triton_logprobs` on CUDA (no [b, V]
    copies), else torch."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and 0 < logits.shape[-1]:
        from kestrel.ops.sampling.triton_logprobs import token_logprobs_triton

        return token_logprobs_triton(logits, tokens, k, rows)
    if rows is not None:
        logits, tokens = logits.index_select(0, rows), tokens.index_select(0, rows)
    return naive.token_logprobs(logits, tokens, k)


__all__ = ["argmax", "greedy", "token_logprobs"]
