"""The MoE router in one kernel: sigmoid, correction bias (selection only), top-k, renormalize, scale; at decode
sizes also the router's logits themselves (`route_hidden_triton`: the fp32 product with the router weight).

Legend: T tokens, D hidden width, E experts (padded to a power of two inside the kernel), A = experts per token.
Reference: `naive.route` with one expert group (the K3 / Kimi-Linear setting); ties go to the lower expert id
there and here (argmax returns the first maximum). Grouped routing stays on the reference path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select(
    x,
    cols,
    mask,
    t,
    bias,
    weights_out,
    ids_out,
    scaling,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    A: tl.constexpr,
):
    """Routing of token t from its fp32 logits x [BE]: sigmoid, the biased top-A (the first maximum on ties),
    the weights renormalized (or not) and scaled, stored best first."""
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
    _select(x, cols, mask, t, bias, weights_out, ids_out, scaling, HAS_BIAS, RENORM, A)


@triton.jit
def _router_gemv_kernel(
    h,
    weight,
    bias,
    weights_out,
    ids_out,
    E,
    D,
    stride_h,
    scaling,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    A: tl.constexpr,
    BE: tl.constexpr,
    BD: tl.constexpr,
):
    """The router's logits of token t (fp32: h[t] . weight[e] for every expert) and its routing, one program."""
    t = tl.program_id(0)
    cols = tl.arange(0, BE)
    mask = cols < E
    acc = tl.zeros([BE], dtype=tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        dmask = ds < D
        x = tl.load(h + t.to(tl.int64) * stride_h + ds, mask=dmask, other=0.0).to(tl.float32)  # [BD]
        w = tl.load(weight + cols[:, None] * D + ds[None, :], mask=mask[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)  # [BE]
    _select(acc, cols, mask, t, bias, weights_out, ids_out, scaling, HAS_BIAS, RENORM, A)


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
    return _route(
        _router_kernel,
        (logits,),
        (E, logits.stride(0)),
        T,
        E,
        correction_bias,
        top_k,
        renormalize,
        scaling_factor,
    )


def route_hidden_triton(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    block_d: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_triton(hidden.float() @ router_weight.float().t(), ...)` in one kernel: hidden [T, D] (rows may
    be strided), router_weight [E, D]; the logits in fp32 (another summation order than the matmul's).
    Decode saves the cast and the matmul's launches. Returns (weights [T, A] fp32, ids [T, A] int64)."""
    T, D = hidden.shape
    E = router_weight.shape[0]
    assert router_weight.shape == (E, D) and hidden.stride(1) == 1
    inputs = (hidden, router_weight.contiguous())
    sizes = (E, D, hidden.stride(0))
    return _route(
        _router_gemv_kernel,
        inputs,
        sizes,
        T,
        E,
        correction_bias,
        top_k,
        renormalize,
        scaling_factor,
        BD=block_d,
    )


def _route(kernel, inputs, sizes, T, E, correction_bias, top_k, renormalize, scaling_factor, **meta):
    """One program per token: kernel(*inputs, bias, weights, ids, *sizes, scaling, flags) into new outputs."""
    device = inputs[0].device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)  # [T, A]
    ids = torch.empty(T, top_k, dtype=torch.int64, device=device)  # [T, A]
    if T == 0:
        return weights, ids
    bias = correction_bias if correction_bias is not None else inputs[0]  # unused without HAS_BIAS
    kernel[(T,)](
        *inputs,
        bias,
        weights,
        ids,
        *sizes,
        float(scaling_factor),
        HAS_BIAS=correction_bias is not None,
        RENORM=renormalize,
        A=top_k,
        BE=triton.next_power_of_2(E),
        **meta,
    )
    return weights, ids
