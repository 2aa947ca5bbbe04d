"""The router's fp32 logits of many tokens as one bf16 tensor-core GEMM, with products as exact as fp32's.

Legend: T tokens, D hidden size, E routed experts.

The reference is x.float() @ w.t() with w fp32 [E, D]: on the GPU a SIMT fp32 GEMM (cuBLAS' ffma kernels) plus
a cast of x to fp32, about 0.4 ms a layer for 32K tokens of `mini` on the H200 (5.2 ms of the fp32 GEMM and
~4 ms of casts in a 217 ms prefill step, session 11's profile). Here w is split into three bf16 parts,
w = hi + mid + lo exactly (each part holds the next 8 significant bits of w's 24), and bf16 x times the
stacked parts [3E, D] runs as one bf16 GEMM with fp32 output. A bf16 x times a bf16 part is exact in fp32, so
every product x[t, d] * w[e, d] is exact, as in the reference; the sums run in the tensor cores' fp32
accumulation in another order (three partial dot products, then added). On the H200 at mini's sizes the max
error against an fp64 reference was 1.0e-5 where cuBLAS' fp32 GEMM's was 1.9e-6, both within the fp32 bound
D * 2^-24 * sum |x w| (session 11): a token on a near-tie between experts can pick another one than the fp32
GEMM would.
"""

from __future__ import annotations

import functools

import torch


def split_bf16x3(w: torch.Tensor) -> torch.Tensor:
    """fp32 w [E, D] -> [3E, D] bf16: hi, mid and lo stacked, with hi + mid + lo == w exactly in fp32 for
    2^-110 <= |w| <= bf16's largest finite value (~3.39e38) and for 0; below 2^-110 lo falls into bf16's
    subnormals and loses bits. NaN stays NaN; an infinite w splits into inf, NaN, NaN (its logit is NaN)."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()  # exact: the low 16 significant bits (with the sign the rounding gave them)
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)  # exact: at most 8 significant bits are left
    return torch.cat([hi, mid, lo])


@functools.cache
def mm_fp32_out_works(device: torch.device) -> bool:
    """Whether torch.mm(bf16, bf16, out_dtype=torch.float32) runs here (CUDA in recent torch)."""
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def router_logit_parts_bf16x3(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x [T, D] bf16, parts = split_bf16x3(w) [3E, D] -> [T, 3, E] fp32: x times hi, mid and lo, whose sum over
    the middle dim is `router_logits_bf16x3` (the fused router adds them itself: one reduction kernel fewer).
    Needs mm_fp32_out_works(x.device)."""
    E = parts.shape[0] // 3
    return torch.mm(x, parts.t(), out_dtype=torch.float32).view(-1, 3, E)  # [T, 3, E]


def router_logits_bf16x3(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x [T, D] bf16, parts = split_bf16x3(w) [3E, D] -> logits [T, E] fp32, equal to x.float() @ w.t() up to
    fp32 rounding. Needs mm_fp32_out_works(x.device)."""
    return router_logit_parts_bf16x3(x, parts).sum(1)  # [T, E]
