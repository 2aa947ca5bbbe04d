"""The MoE router in one kernel: sigmoid, correction bias (selection only), top-k, renormalize, scale.

Legend: T tokens, E experts (padded to a power of two inside the kernel), A = experts per token.
Reference: `naive.route` with one expert group (the K3 / Kimi-Linear setting); ties go to the lower expert id
there and here (argmax returns the first maximum). Grouped routing stays on the reference path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _router_kernel(
    logits,
    bias,
    weights_out,
    ids_out,
    E,
    stride_t,
    scaling,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    A: tl.constexpr,
    BE: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.arange(0, BE)
    mask = cols < E
    x = tl.load(logits + t * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(x)  # [BE] the scores the weights come from
    sel = s
    if HAS_BIAS:
        sel = s + tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
    sel = tl.where(mask, sel, float("-inf"))
    total = 0.0
    for a in tl.static_range(A):
        best = tl.argmax(sel, axis=0)  # the first maximum: the lowest expert id among ties
        w = tl.sum(tl.where(cols == best, s, 0.0), axis=0)
        tl.store(ids_out + t * A + a, best.to(tl.int64))
        tl.store(weights_out + t * A + a, w)
        total += w
        sel = tl.where(cols == best, float("-inf"), sel)
    if RENORM:
        for a in tl.static_range(A):
            w = tl.load(weights_out + t * A + a)
            tl.store(weights_out + t * A + a, w / (total + 1e-20) * scaling)
    else:
        for a in tl.static_range(A):
            w = tl.load(weights_out + t * A + a)
            tl.store(weights_out + t * A + a, w * scaling)


def route_triton(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `naive.route` with num_groups == 1: (weights [T, A] fp32, ids [T, A] int64), best first."""
    T, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    bias = correction_bias if correction_bias is not None else logits  # unused when HAS_BIAS is false
    _router_kernel[(T,)](
        logits,
        bias,
        weights,
        ids,
        E,
        logits.stride(0),
        float(scaling_factor),
        HAS_BIAS=correction_bias is not None,
        RENORM=renormalize,
        A=top_k,
        BE=triton.next_power_of_2(E),
    )
    return weights, ids
