"""The KDA short-conv decode step on the state slots themselves (CUDA-graph safe, no gather/scatter copies).

Legend: N sequences (one new token each), C channels (q|k|v), W conv width, S pool slots.
Reference: `naive.short_conv_step` on the gathered windows, then the windows scattered back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.norm.triton_norm import row_align
from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def conv_window_step(x_new, cols, mask, slot, weight, pool, stride_ps, stride_pc, W: tl.constexpr,
                     WP: tl.constexpr):  # fmt: skip
    """One decode step of channels cols [BC] (mask: the live ones) of pool slot `slot`: SiLU(conv over
    [window | x_new]) [BC] fp32 returned, the window [BC, W - 1] shifted by x_new in place. x_new [BC] fp32 (the
    input as stored). The window is read and written as one 2D tile (in the engine's pool a channel's W - 1 values
    are adjacent and channels follow each other, so the tile is one contiguous span; read a tap at a time, each
    load took every (W - 1)-th element). Also the rows GEMV's epilogue (kestrel.ops.linear.triton_gemv)."""
    js = tl.arange(0, WP)  # [WP] window positions (W - 1 of them used) and taps (W)
    base = pool + slot * stride_ps + cols[:, None] * stride_pc + js[None, :]  # [BC, WP] the windows
    old = mask[:, None] & (js < W - 1)[None, :]
    taps = tl.load(
        weight + cols[:, None] * W + js[None, :], mask=mask[:, None] & (js < W)[None, :], other=0.0
    )
    taps = taps.to(tl.float32)  # [BC, WP]; window position j holds the input of W-1-j steps ago
    win = tl.load(base, mask=old, other=0.0).to(tl.float32)  # [BC, WP]
    win = tl.where((js == W - 1)[None, :], x_new[:, None], win)  # tap W-1: the new input
    acc = tl.sum(win * taps, axis=1)  # [BC]
    # the window shifted left by one, the new input appended (a second read of the span: from cache)
    later = tl.load(base + 1, mask=mask[:, None] & (js < W - 2)[None, :], other=0.0)  # [BC, WP]
    shifted = tl.where((js == W - 2)[None, :], x_new[:, None].to(pool.dtype.element_ty), later)
    tl.debug_barrier()  # every read of the window before any write
    tl.store(base, shifted, mask=old)
    return acc * tl.sigmoid(acc)  # SiLU


@triton.jit
def _conv_step_kernel(
    x,
    weight,
    pool,
    slots,
    y,
    N,
    C,
    PC,
    xn_units,
    stride_ps,
    stride_pc,
    X_ALIGN: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BC: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (n, c-block): sequence n's channels cols through `conv_window_step`."""
    pdl_begin(PDL)
    stride_xn = xn_units * X_ALIGN  # x's row stride: a known multiple of X_ALIGN, so rows load as vectors
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    cols = i_c * BC + tl.arange(0, BC)  # [BC]
    mask = cols < C
    slot = tl.load(slots + i_n).to(tl.int64)
    x_new = tl.load(x + i_n * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)  # [BC]
    out = conv_window_step(x_new, cols, mask, slot, weight, pool, stride_ps, stride_pc, W, WP)
    # y is planes [C // PC, N, PC]: channel c of sequence n at (c // PC, n, c % PC)
    tl.store(y + (cols // PC) * N * PC + i_n * PC + cols % PC, out.to(y.dtype.element_ty), mask=mask)


def conv_step_inplace(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    planes: int = 1,
    block: int = 256,
) -> torch.Tensor:
    """y = SiLU(conv over [window | x]); each slot's window [C, W-1] in conv_pool [S, C, W-1] advances in
    place. x [N, C] (rows may be strided: a column slice of a wider matmul), weight [C, W] contiguous,
    slots [N] (distinct, or the dummy slot 0). y is [N, C], or with planes > 1 [planes, N, C / planes]: the
    channel groups (q | k | v) each contiguous, so that the recurrence reads them without copies."""
    N, C = x.shape
    W = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_pool.stride(2) == 1 and C % planes == 0
    y = x.new_empty(planes, N, C // planes)
    grid = (N, triton.cdiv(C, block))
    x_align = row_align(x.stride(0))
    _conv_step_kernel[grid](
        x,
        weight,
        conv_pool,
        slots,
        y,
        N,
        C,
        C // planes,
        x.stride(0) // x_align,
        conv_pool.stride(0),
        conv_pool.stride(1),
        X_ALIGN=x_align,
        W=W,
        WP=triton.next_power_of_2(W),
        BC=block,
        **pdl_args(y),
    )
    return y if planes > 1 else y[0]


@triton.jit
def _conv_taps(x, weight, state, n, bos, t, c, cmask, live, stride_xt, stride_sn, stride_sc,
               W: tl.constexpr, USE_STATE: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """sum_j weight[c, j] * in[t - (W - 1) + j, c] over the tile [BT, BC], fp32; with USE_STATE the inputs before
    a token's sequence come from the sequence's state, else they are zeros (no token of the tile needs one)."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j  # [BT] the input this tap reads
        inside = (src >= bos)[:, None]
        v = tl.load(x + src[:, None].to(tl.int64) * stride_xt + c[None, :], mask=live & inside, other=0.0)
        v = v.to(tl.float32)
        if USE_STATE:  # before the sequence: its state's column (W - 1) - (bos - src), rounded to x's dtype
            col = (W - 1) - (bos - src)  # [BT]
            s_ptr = state + n[:, None].to(tl.int64) * stride_sn + c[None, :] * stride_sc + col[:, None]
            s = tl.load(s_ptr, mask=live & ~inside, other=0.0).to(x.dtype.element_ty).to(tl.float32)
            v = tl.where(inside, v, s)
        w = tl.load(weight + c * W + j, mask=cmask, other=0.0).to(tl.float32)  # [BC]
        acc += v * w[None, :]
    return acc


@triton.jit
def _prefill_conv_kernel(
    x,
    weight,
    state,
    seq,
    cu,
    y,
    T,
    C,
    PC,
    xt_units,
    stride_sn,
    stride_sc,
    X_ALIGN: tl.constexpr,
    W: tl.constexpr,
    HAS_STATE: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """y[t, c] = SiLU(sum_j weight[c, j] * in[t - (W - 1) + j, c]) where `in` is x from the token's sequence
    start on and the sequence's state (its last W - 1 inputs, newest last) before it. y is planes
    [C // PC, T, PC]: channel c of token t at (c // PC, t, c % PC)."""
    stride_xt = xt_units * X_ALIGN  # x's row stride: a known multiple of X_ALIGN, so rows load as vectors
    t = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT] tokens
    c = tl.program_id(1) * BC + tl.arange(0, BC)  # [BC] channels
    tmask, cmask = t < T, c < C
    n = tl.load(seq + t, mask=tmask, other=0)  # [BT] each token's sequence
    bos = tl.load(cu + n, mask=tmask, other=0)  # [BT] its first token
    live = tmask[:, None] & cmask[None, :]
    # Only the first W - 1 tokens of a sequence read its state: a tile without one runs the taps without the
    # state's loads and address arithmetic, chosen once per tile (on the H200 a 32K-token step's conv took
    # 0.56 ms with a state against 0.19 ms without one, and 0.38 ms with the choice inside each tap).
    near = False
    if HAS_STATE:
        near = tl.min(tl.where(tmask, t - bos, W)) < W - 1
    if near:
        acc = _conv_taps(x, weight, state, n, bos, t, c, cmask, live, stride_xt, stride_sn, stride_sc,
                         W, True, BT, BC)  # fmt: skip
    else:
        acc = _conv_taps(x, weight, state, n, bos, t, c, cmask, live, stride_xt, stride_sn, stride_sc,
                         W, False, BT, BC)  # fmt: skip
    out = acc * tl.sigmoid(acc)
    plane = (c // PC).to(tl.int64) * T * PC + c % PC  # [BC]
    tl.store(y + plane[None, :] + t[:, None].to(tl.int64) * PC, out.to(y.dtype.element_ty), mask=live)


def short_conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    planes: int = 1,
    block_t: int = 16,
    block_c: int = 256,
    num_warps: int = 4,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive.short_conv` at inference in one Triton kernel over the packed tokens, no host syncs: x [T, C]
    (rows may be strided), weight [C, W], conv_state [N, C, W - 1] or None, cu_seqlens [N + 1] or None
    (cu_seqlens_cpu is unused: nothing is read on the host).
    Returns (y [T, C] in x.dtype, new_state [N, C, W - 1] in x.dtype). Forward only: training keeps the packed
    torch form, which has a backward. The packed form gathers a [T, C, W] copy of the windows in fp32 and
    reduces it, about 135 ms of a 32K-token prefill step of `mini` on the H200. The tile: 16 tokens x 256 channels
    in 4 warps, 188 us at T = 32768, C = 3072 on the H200 against 290 us for the earlier 32 x 128 in 8 warps
    (`kestrel bench kernels`, bench/results/2026-11-30-h200-session9.json). With planes > 1, y is
    [planes, T, C / planes], each plane contiguous: the KDA layer's q, k, v, which the chunked kernels then read
    without copying them (54 copies of [32768, 8, 128] in a 32K-token prefill step of mini: 4.3 ms)."""
    T, C = x.shape
    W = weight.shape[-1]
    S = W - 1
    assert x.stride(1) == 1 and weight.is_contiguous() and C % planes == 0
    dev = x.device
    cu = (cu_seqlens if cu_seqlens is not None else torch.tensor([0, T], device=dev)).to(dev, torch.int64)
    N = cu.numel() - 1
    if conv_state is not None:
        assert conv_state.shape == (N, C, S), f"conv_state {tuple(conv_state.shape)} != {(N, C, S)}"
        conv_state = conv_state if conv_state.stride(2) == 1 else conv_state.contiguous()
    y = x.new_empty(planes, T, C // planes)
    if T:
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=dev), right=True)  # [T]
        state = conv_state if conv_state is not None else y  # (not read without a state)
        grid = (triton.cdiv(T, block_t), triton.cdiv(C, block_c))
        x_align = row_align(x.stride(0))
        _prefill_conv_kernel[grid](
            x,
            weight,
            state,
            seq,
            cu,
            y,
            T,
            C,
            C // planes,
            x.stride(0) // x_align,
            state.stride(0) if conv_state is not None else 0,
            state.stride(1) if conv_state is not None else 0,
            X_ALIGN=x_align,
            W=W,
            HAS_STATE=conv_state is not None,
            BT=block_t,
            BC=block_c,
            num_warps=num_warps,
        )
    # the new state: each sequence's last W - 1 inputs, from its state where the sequence is shorter
    starts, ends = cu[:-1, None], cu[1:, None]  # [N, 1]
    pos = ends - S + torch.arange(S, device=dev)  # [N, S]
    inside = pos >= starts
    tail = x[pos.clamp(min=0, max=max(T - 1, 0))].transpose(1, 2) if T else x.new_zeros(N, C, S)  # [N, C, S]
    if conv_state is None:
        old = tail.new_zeros(N, C, S)
    else:
        col = (S - (starts - pos)).clamp(0, max(S - 1, 0))  # [N, S]
        old = conv_state.to(x.dtype).gather(2, col[:, None, :].expand(N, C, S))
    return (y if planes > 1 else y[0]), torch.where(inside[:, None, :], tail, old)
