"""The KDA decode step on the state slots themselves, in Triton: one token per sequence, the state read from its
slot and written back in place (CUDA-graph safe, no gather/scatter copies).

Legend: N sequences, H heads, K key dims, V value dims, S pool slots; BV value columns a program.
Reference: `naive.recurrent_inplace` (gather the states, `recurrent_kda`, scatter them back); the same contract
as fla-core's continuous-batching `fused_recurrent_kda_fwd` (kestrel.ops.kda.fla.recurrent_inplace), which this
kernel stands in for, except for a negative slot, which only this kernel skips (the reference wraps it to the
last slot, fla's kernel addresses memory before the pool; the engine pads a batch with slot 0, never -1).
Per (sequence, head), model-spec 1.3 for one token, fp32 inside:

    q, k <- l2norm(q), l2norm(k) (optional);  q <- q * scale
    g    <- the decay: lb * sigmoid(exp(A_log[h]) * (f + dt_bias)), or -exp(A_log[h]) * softplus(f + dt_bias)
    S'   =  Diag(exp g) S;   u = beta (v - S'^T k);   S = S' + k u^T;   o = S^T q

A program holds a [K, BV] block of one head's fp32 state: it reads it once, writes it once, and recomputes the
head's q, k and gate itself (K values: nothing beside the state's 4 K BV bytes). For up to 16 sequences
(`kestrel.ops.kda.F_B_MAX_ROWS`) it makes the raw forget projection too, from f_a and its head's rows of f_b
(loaded before the PDL wait), in place of the f_b GEMV's launch. The state is all the bytes that
matter: mini's batch-256 step moves 5.0 GB of KDA state through 18 layers. Loading the state before the PDL
wait (it overlaps the kernel before; no kernel of the step writes it) was slower on the H200 (session 24, 18
layers in a graph at batch 256: 80.6 us a layer against 76.3): not kept. The state's loads and stores marked
evict-first: 77.5 -> 75.0 us a layer at batch 256, 23.3 -> 22.6 at 64, the same bits (session 24; streaming
stores alone 76.5). Tried and dropped (session 41): the conv step inside this kernel's launch, each program
computing its head's q and k and its own v columns from the windows, the last of a head's value blocks to arrive
(an acq_rel count a slot and head) writing the q and k windows. 18 launches a step fewer, yet mini's replayed step
at 4K was slower, each against the session's starting tree in the same call: batch 1 1.495 against 1.577 ms
(without it, another call: 1.456 against 1.590), batch 256 7.683 against 6.406 (without it: 6.347 against 6.399).
Its fp32 conv outputs were also not the conv kernel's bits (the taps' sum reduced in another tile shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_launch_next, pdl_wait


@triton.jit
def _recurrent_step_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    slots,
    o,
    f_b,
    A_log,
    dt_bias,
    lower_bound,
    scale,
    K,
    V,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_gn,
    stride_gh,
    stride_bn,
    stride_bh,
    stride_on,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    K_F,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    BKF: tl.constexpr = 16,
    FOLD_F_B: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    i_v, h, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    ok_k, ok_v = offs_k < K, offs_v < V
    pdl_launch_next(PDL)
    if FOLD_F_B:  # the head's rows of f_b [H * K, K_F]: weights, which no kernel writes, so before the wait
        offs_f = tl.arange(0, BKF)
        ok_f = offs_f < K_F
        w_fb = tl.load(
            f_b + (h * K + offs_k)[:, None].to(tl.int64) * K_F + offs_f[None, :],
            mask=ok_k[:, None] & ok_f[None, :],
            other=0.0,
        )  # [BK, BKF]
    pdl_wait(PDL)
    slot = tl.load(slots + n).to(tl.int64)
    live = (offs_v * 0 + slot) >= 0  # [BV]; a negative slot: nothing read or written, o = 0
    s_ptr = state + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    s_mask = ok_k[:, None] & (ok_v & live)[None, :]
    # [BK, BV] fp32, the first load: the rest waits on it anyway. The state streams through once a step: its
    # lines go first when L2 needs room (evict_first on the load and the store)
    S = tl.load(s_ptr, mask=s_mask, other=0.0, eviction_policy="evict_first")

    bq = tl.load(q + n * stride_qn + h * stride_qh + offs_k, mask=ok_k, other=0.0).to(tl.float32)
    bk = tl.load(k + n * stride_kn + h * stride_kh + offs_k, mask=ok_k, other=0.0).to(tl.float32)
    bv = tl.load(v + n * stride_vn + h * stride_vh + offs_v, mask=ok_v, other=0.0).to(tl.float32)
    if FOLD_F_B:  # g is f_a [N, 1, K_F]: the raw forget projection f_a f_b^T, rounded as a GEMV rounds it
        f_a = tl.load(g + n * stride_gn + offs_f, mask=ok_f, other=0.0).to(tl.float32)
        bg = tl.sum(w_fb.to(tl.float32) * f_a[None, :], 1).to(g.dtype.element_ty).to(tl.float32)  # [BK]
    else:
        bg = tl.load(g + n * stride_gn + h * stride_gh + offs_k, mask=ok_k, other=0.0).to(tl.float32)
    b = tl.load(beta + n * stride_bn + h * stride_bh).to(tl.float32)
    if L2NORM:
        bq = bq / tl.sqrt(tl.sum(bq * bq, 0) + 1e-6)
        bk = bk / tl.sqrt(tl.sum(bk * bk, 0) + 1e-6)
    bq = bq * scale
    if GATE:
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        x = bg + tl.load(dt_bias + h * K + offs_k, mask=ok_k, other=0.0).to(tl.float32)
        if LOWER_BOUND:
            bg = lower_bound * tl.sigmoid(a * x)
        else:
            bg = -a * tl.where(
                x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))
            )  # softplus, torch's threshold
        bg = tl.where(ok_k, bg, 0.0)
    if BETA_SIGMOID:
        b = tl.sigmoid(b)

    S = S * tl.exp(bg)[:, None]  # S' = Diag(exp g) S
    u = b * (bv - tl.sum(S * bk[:, None], 0))  # [BV]
    S = S + bk[:, None] * u[None, :]
    out = tl.sum(S * bq[:, None], 0)  # [BV]
    tl.store(
        o + n * stride_on + h * stride_oh + offs_v, tl.where(live, out, 0.0).to(o.dtype.element_ty), mask=ok_v
    )
    tl.store(s_ptr, S, mask=s_mask, eviction_policy="evict_first")


def choose_block_v(N: int, V: int) -> int:
    """Value columns a program. On the H200 at mini's sizes (8 heads of 128 x 128, 18 layers in a CUDA graph,
    session 20, scripts/decode_kernels_check.py's kda_step), us a layer, ours at block_v 16 / 32 / 64 against
    fla-core's kernel (32 columns): batch 1 3.5 / 4.0 / - vs 5.6; batch 64 24.2 / 23.6 / 23.3 vs 27.5;
    batch 256 96.8 / 80.9 / 75.4 vs 89.8 (the state's floor 63.2: 84% of it). Few sequences want more
    programs, many want longer rows of state a program."""
    return min(triton.next_power_of_2(V), 16 if N < 16 else 64)


def recurrent_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    gate: tuple | None = None,
    beta_logits: bool = False,
    f_b: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """`naive.recurrent_inplace`'s contract: q, k, g [N, 1, H, K], v [N, 1, H, V], beta [N, 1, H] (any strides
    with a unit last stride: no copies); state_pool [S, H, K, V] fp32, sequence n's state at slot slots[n]
    (distinct slots; a negative slot is skipped and gives o = 0). gate = (A_log [H], dt_bias [H * K], lower_bound
    or None): g is the raw forget projection; beta_logits: beta is before its sigmoid. Returns o [N, 1, H, V] in
    v.dtype. f_b [H * K, K_F] (contiguous, g's dtype): g is f_a [N, 1, K_F] and the raw forget projection is
    f_a f_b^T, made in the kernel (`kestrel.ops.kda.F_B_MAX_ROWS`). block_v value columns a program (None:
    `choose_block_v`), num_warps its warps."""
    N, _, H, K = q.shape
    V = v.shape[-1]
    K_F = 1
    if f_b is not None:
        K_F = f_b.shape[-1]
        assert f_b.shape == (H * K, K_F) and f_b.is_contiguous(), (
            f"f_b {tuple(f_b.shape)}: [H * K, K_F] contiguous"
        )
        assert g.shape == (N, 1, K_F) and f_b.dtype == g.dtype, (
            "with f_b, g is f_a [N, 1, K_F] of f_b's dtype"
        )
    else:
        assert g.shape == q.shape, "g [N, 1, H, K]"
    assert k.shape == q.shape and v.shape == (N, 1, H, V) and beta.shape == (N, 1, H)
    assert state_pool.shape[1:] == (H, K, V) and state_pool.stride(-1) == 1, "state_pool [S, H, K, V]"
    assert state_pool.dtype == torch.float32, "the state is fp32"
    assert all(t.stride(-1) == 1 for t in (q, k, v, g)), "unit last stride"
    if N > 65535:
        raise ValueError(f"recurrent_inplace: {N} sequences in one step; the grid takes at most 65535")
    o = torch.empty(N, 1, H, V, dtype=v.dtype, device=v.device)
    if N == 0 or H == 0:
        return o
    if gate is not None:
        A_log, dt_bias, lower_bound = gate
        A_log, dt_bias = A_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous()
        assert A_log.numel() == H and dt_bias.numel() == H * K, "A_log [H], dt_bias [H * K]"
    else:
        A_log = dt_bias = g  # placeholders, never read
        lower_bound = None
    block_v = block_v or choose_block_v(N, V)
    grid = (triton.cdiv(V, block_v), H, N)
    _recurrent_step_kernel[grid](
        q, k, v, g, beta, state_pool, slots, o, g if f_b is None else f_b, A_log, dt_bias,
        0.0 if lower_bound is None else float(lower_bound),
        K**-0.5 if scale is None else float(scale),
        K, V,
        q.stride(0), q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2), g.stride(0), g.stride(-2),
        beta.stride(0), beta.stride(2), o.stride(0), o.stride(2),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), K_F,
        BK=triton.next_power_of_2(K), BV=block_v, L2NORM=use_qk_l2norm, GATE=gate is not None,
        LOWER_BOUND=lower_bound is not None, BETA_SIGMOID=beta_logits,
        BKF=max(16, triton.next_power_of_2(K_F)), FOLD_F_B=f_b is not None, num_warps=num_warps,
        **pdl_args(o),
    )  # fmt: skip
    return o
