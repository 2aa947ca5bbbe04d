"""FP8 (E4M3) with one fp32 scale per row: the optional storage of the DSA indexer keys in the KV pool.

q = round_to_e4m3(x / s), s = max|x| / 448 over the row (448 = the largest E4M3 value), x ~ q * s.
E4M3 keeps 3 mantissa bits: each element's error is at most 2^-4 of its magnitude, plus the scale's
underflow floor for elements far below the row's maximum.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] float8_e4m3fn, scale [..., 1] fp32)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [..., 1]
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., D] fp8, scale [..., 1]) -> x [..., D] in `dtype`."""
    return (q.float() * scale.float()).to(dtype)
