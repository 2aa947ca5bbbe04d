"""The MoE router in one kernel: sigmoid, correction bias (selection only), top-k, renormalize, scale; at decode
sizes also the router's logits themselves (`route_hidden_triton`: the fp32 product with the router weight, in
two kernels).

Legend: T tokens, D hidden width, E experts (padded to a power of two inside the kernel), A = experts per token.
Reference: `naive.route` with one expert group (the K3 / Kimi-Linear setting); ties go to the lower expert id
there and here (argmax returns the first maximum). Grouped routing stays on the reference path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def _pick(
    x, cols, mask, bias, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, A: tl.constexpr, BA: tl.constexpr
):
    """A token's routing from its fp32 logits x [BE]: sigmoid, the biased top-A (the first maximum on ties), the
    weights renormalized (or not), unscaled. Returns (weights [BA] fp32, ids [BA] int64), best first; slots past
    A hold zeros."""
    s = tl.sigmoid(x)  # [BE] the scores the weights come from
    sel = s
    if HAS_BIAS:
        sel = s + tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
    sel = tl.where(mask, sel, float("-inf"))
    slots = tl.arange(0, BA)
    w_top = tl.zeros([BA], dtype=tl.float32)
    id_top = tl.zeros([BA], dtype=tl.int64)
    for a in tl.static_range(A):
        best = tl.argmax(sel, axis=0)  # the first maximum: the lowest expert id among ties
        w = tl.sum(tl.where(cols == best, s, 0.0), axis=0)
        w_top = tl.where(slots == a, w, w_top)
        id_top = tl.where(slots == a, best.to(tl.int64), id_top)
        sel = tl.where(cols == best, float("-inf"), sel)
    if RENORM:
        w_top = w_top / (tl.sum(w_top, axis=0) + 1e-20)  # slots past A hold zeros
    return w_top, id_top


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
    BA: tl.constexpr,
):
    """`_pick` for token t, its scaled weights and ids stored best first (one store each)."""
    w_top, id_top = _pick(x, cols, mask, bias, HAS_BIAS, RENORM, A, BA)
    slots = tl.arange(0, BA)
    tl.store(weights_out + t * A + slots, w_top * scaling, mask=slots < A)
    tl.store(ids_out + t * A + slots, id_top, mask=slots < A)


@triton.jit
def _slice_logits(x_row, weight, s, E, D, BE: tl.constexpr, BD: tl.constexpr):
    """A token's fp32 logits [BE] over the hidden slice [s * BD, (s + 1) * BD), every expert at once (x_row: the
    token's hidden row)."""
    return _slice_dot(x_row, _slice_weights(weight, s, E, D, BE, BD), s, D, BD)


@triton.jit
def _slice_weights(weight, s, E, D, BE: tl.constexpr, BD: tl.constexpr):
    """The router weight's columns of hidden slice s for its first E experts (the rest zeros, not read): [BE, BD]."""
    cols = tl.arange(0, BE)
    ds = s * BD + tl.arange(0, BD)
    mask = (cols < E)[:, None] & (ds < D)[None, :]
    return tl.load(weight + cols[:, None] * D + ds[None, :], mask=mask, other=0.0)


@triton.jit
def _slice_dot(x_row, w, s, D, BD: tl.constexpr):
    """`_slice_logits` from the slice's weights w [BE, BD] (`_slice_weights`)."""
    ds = s * BD + tl.arange(0, BD)
    x = tl.load(x_row + ds, mask=ds < D, other=0.0).to(tl.float32)  # [BD]
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _summed_logits(partial_row, S, stride_s, E, BE: tl.constexpr, BS: tl.constexpr, CACHE: tl.constexpr):
    """A token's logits [BE]: its S partial sums (partial_row[s * stride_s + e]) added in a fixed order (the
    same bits on every run and in every program); CACHE the loads' cache modifier ("" for none). CACHE has no
    default on purpose: compiled Triton 3.6 passes a called helper's string default as a plain str, not a
    constexpr, and fails (the interpreter does not: CI passed, the H200 failed, session 37)."""
    cols = tl.arange(0, BE)
    acc = tl.zeros([BE], dtype=tl.float32)
    for s0 in range(0, S, BS):
        rows = s0 + tl.arange(0, BS)
        p = tl.load(
            partial_row + rows[:, None] * stride_s + cols[None, :],
            mask=(rows < S)[:, None] & (cols < E)[None, :],
            other=0.0,
            cache_modifier=CACHE,
        )
        acc += tl.sum(p.to(tl.float32), axis=0)
    return acc


@triton.jit
def _router_partial_kernel(
    h, weight, partial, E, D, stride_h, S, BE: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False
):
    """Program (t, s): token t's fp32 logits over the hidden slice [s * BD, (s + 1) * BD), every expert at
    once, into partial[t, s, :BE]. The slices run side by side instead of one after another in one program."""
    pdl_begin(PDL)
    t = tl.program_id(0)
    s = tl.program_id(1)
    logits = _slice_logits(h + t.to(tl.int64) * stride_h, weight, s, E, D, BE, BD)
    tl.store(partial + (t.to(tl.int64) * S + s) * BE + tl.arange(0, BE), logits)


@triton.jit
def _router_dot_kernel(
    x, parts, partial, T, D, E, stride_x, S, BT: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (b, s): tokens b * BT .. b * BT + BT - 1, hidden slice [s * BD, (s + 1) * BD): x's bf16 tile times
    the three bf16 parts of the router weight (hi, mid, lo: parts [3E, D]), each product exact in the fp32
    accumulator, hi's dot first, into partial[t, s, :BE]."""
    pdl_begin(PDL)
    ts = tl.program_id(0) * BT + tl.arange(0, BT)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    es = tl.arange(0, BE)
    tmask, dmask = ts < T, ds < D
    xt = tl.load(
        x + ts[:, None].to(tl.int64) * stride_x + ds[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0
    )
    if DOT_F32:  # Triton's CPU interpreter misreads bf16 dot operands: fp32 there (the products stay exact)
        xt = xt.to(tl.float32)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for p in tl.static_range(3):
        w = tl.load(
            parts + (p * E + es)[:, None] * D + ds[None, :],
            mask=(es < E)[:, None] & dmask[None, :],
            other=0.0,
        )
        if DOT_F32:
            w = w.to(tl.float32)
        acc = tl.dot(xt, tl.trans(w), acc=acc, input_precision="ieee" if DOT_F32 else "tf32")  # [BT, BE]
    tl.store(
        partial + (ts[:, None].to(tl.int64) * S + tl.program_id(1)) * BE + es[None, :],
        acc,
        mask=tmask[:, None],
    )


def router_logit_parts_triton(x: torch.Tensor, parts: torch.Tensor, programs: int = 128) -> torch.Tensor:
    """`router_gemm.router_logit_parts_bf16x3(x, parts)` in one Triton kernel, summed differently: x [T, D] bf16
    (rows may be strided), parts = split_bf16x3(w) [3E, D] bf16 -> [T, S, E] fp32 partial logits over S slices of
    D (each slice's three part products added in its fp32 accumulator), which `route_triton` adds in a fixed
    order. Blocks of 16-64 tokens; slices 32-512 wide, about `programs` programs in all. For decode batches
    past the GEMV router's (17-128 tokens, kestrel.layers.moe.ROUTER_DOT_MAX_TOKENS): there it beats cuBLAS's
    GEMM and the sum after it (at 64 tokens on mini 7.0 against 8.7 us a call); from 256 tokens the sum over
    its many slices costs more than cuBLAS's GEMM saves."""
    T, D = x.shape
    E = parts.shape[0] // 3
    assert parts.shape == (3 * E, D) and parts.dtype == x.dtype == torch.bfloat16 and x.stride(1) == 1
    BE = triton.next_power_of_2(E)
    BT = min(64, max(16, triton.next_power_of_2(T)), max(16, 8192 // BE))  # the [BT, BE] fp32 accumulator
    blocks = triton.cdiv(T, BT)
    wanted = triton.next_power_of_2(triton.cdiv(D, max(1, programs // blocks)))
    # slices 32-512 wide, narrower for many experts: a part's [BE, BD] tile stays small
    BD = min(512, max(32, wanted), max(32, 16384 // BE))
    S = triton.cdiv(D, BD)
    partial = torch.empty(T, S, BE, dtype=torch.float32, device=x.device)  # [T, S, BE]
    if T:
        _router_dot_kernel[(blocks, S)](
            x, parts.contiguous(), partial, T, D, E, x.stride(0), S, BT=BT, BD=BD, BE=BE, DOT_F32=not x.is_cuda,
            **pdl_args(partial),
        )  # fmt: skip
    return partial[:, :, :E]


@triton.jit
def _router_sum_kernel(
    partial,
    bias,
    weights_out,
    ids_out,
    E,
    S,
    stride_t,
    stride_s,
    scaling,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    A: tl.constexpr,
    BA: tl.constexpr,
    BE: tl.constexpr,
    BS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Token t's logits: its S partial sums (partial[t * stride_t + s * stride_s + e]) added in a fixed order
    (the same bits on every run), then routed."""
    pdl_begin(PDL)
    t = tl.program_id(0)
    cols = tl.arange(0, BE)
    acc = _summed_logits(partial + t.to(tl.int64) * stride_t, S, stride_s, E, BE, BS, "")
    _select(acc, cols, cols < E, t, bias, weights_out, ids_out, scaling, HAS_BIAS, RENORM, A, BA)


def route_triton(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `naive.route` with num_groups == 1: (weights [T, A] fp32, ids [T, A] int64), best first.
    logits [T, E], or [T, S, E] partial logits that sum to them (the router GEMM's three bf16 parts,
    kestrel.ops.moe.router_gemm): added inside, in a fixed order, instead of by a reduction kernel first."""
    if logits.dim() == 2:
        logits = logits[:, None]  # [T, 1, E]: one part
    T, S, E = logits.shape
    logits = logits if logits.stride(2) == 1 else logits.contiguous()
    sizes = (E, S, logits.stride(0), logits.stride(1))
    return _route(
        _router_sum_kernel,
        (logits,),
        sizes,
        T,
        E,
        correction_bias,
        top_k,
        renormalize,
        scaling_factor,
        BS=min(triton.next_power_of_2(S), max(1, 8192 // triton.next_power_of_2(E))),  # [BS, BE] a step
    )


def route_hidden_triton(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    programs: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_triton(hidden.float() @ router_weight.float().t(), ...)` in two small kernels: hidden [T, D] (rows
    may be strided), router_weight [E, D]; the logits in fp32 (another summation order than the matmul's).
    A program per token and slice of the hidden width sums its slice's products; the slices are 32 to 128 wide
    (16 past 256 experts), narrow enough for about `programs` programs where the tokens are few (batch 1: 32
    slices of 64 on mini; from 2 tokens on 128 wide); then one program per token adds the slices in a fixed
    order and routes. The slice width follows the batch, so a token's logits (and, on a near-tie, its experts)
    may differ in the last bits between batch 1 and larger batches, as a GEMM's kernel choice makes them
    differ. Decode saves the cast and the matmul's launches. On the H200 in CUDA graphs at mini's sizes (D
    2048, E 64): at batch 1, 32 slices of 64 took 4.9 us a call where 16 of 128 took 5.5; one program per
    token walking all of D took 44 us (its loads one after another); blocks of 16 tokens through an fp32
    tl.dot were slower than the router GEMM from 64 tokens on (session 22).
    Returns (weights [T, A] fp32, ids [T, A] int64)."""
    T, D = hidden.shape
    E = router_weight.shape[0]
    assert router_weight.shape == (E, D) and hidden.stride(1) == 1
    BE = triton.next_power_of_2(E)
    slices = max(1, programs // max(T, 1))  # wanted slices of D
    BD = min(128, max(32, triton.next_power_of_2(triton.cdiv(D, slices))), max(16, 8192 // BE))
    S = triton.cdiv(D, BD)
    partial = torch.empty(T, S, BE, dtype=torch.float32, device=hidden.device)  # [T, S, BE]
    if T:
        _router_partial_kernel[(T, S)](
            hidden,
            router_weight.contiguous(),
            partial,
            E,
            D,
            hidden.stride(0),
            S,
            BE=BE,
            BD=BD,
            **pdl_args(partial),
        )
    return _route(
        _router_sum_kernel,
        (partial,),
        (E, S, S * BE, BE),
        T,
        E,
        correction_bias,
        top_k,
        renormalize,
        scaling_factor,
        BS=min(triton.next_power_of_2(S), max(1, 8192 // BE)),
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
        BA=triton.next_power_of_2(top_k),
        BE=triton.next_power_of_2(E),
        **meta,
        **pdl_args(weights),
    )
    return weights, ids
