"""Routed experts for small token counts (decode) in Triton: `naive.moe_experts`, same arguments and result.
Also `combine_sorted`, the end of the grouped path (kestrel.ops.moe.grouped) at any size: its expert outputs
summed back to their tokens by the same combine kernel.

Legend: T tokens, A = experts per token, M = T * A (token, slot) pairs, E routed experts, I expert intermediate
size, Din expert input width, BM / BN / BK tile sizes (pairs, output units, reduction). Expert weights are
stacked as in `naive`: w13 [E, 2I, Din] (gate rows, then up rows), w2 [E, Din, I].

The pairs are sorted by expert id on the device (`sort_pairs`: a counting sort up to 2048 pairs, a program per
block of pairs or one for all, torch.sort past that); expert e owns the sorted rows
starts[e]:starts[e + 1] and cuts them into cdiv(count_e, BM) blocks of at most BM pairs. Program (b, n) of each
kernel finds its expert and rows from `starts` alone (a cumulative sum over E inside the kernel), so the grid is
a bound fixed by M and E, min(M, M // BM + E) blocks, programs past the last block return at once: no host
sync, one launch shape per (M, E), capturable by CUDA graphs. With a shared expert (`shared=`, the MoE layer's
shared MLP when it has the experts' width) cdiv(T, BM) more blocks follow, over rows M..M + T - 1 (row M + t is
token t): the shared MLP's own three kernels (gate_up, activation, down) and the add of its output disappear
into the routed experts' launches.
    gate_up:  h[row, n-tile] = act(x[token] . w13[e, gate n-tile], x[token] . w13[e, up n-tile])   [M + S, I]
    down:     y[pair, n-tile] = h[row] . w2[e, n-tile]                                            [M + S, Din]
    combine:  out[t] = sum_a weights[t, a] * y[t * A + a] in slot order (+ y[M + t])              [T, Din]
A block multiplies one weight tile against all its pairs (tl.dot), so each expert's weights are read once per
block: at T = 1 six experts, 6 x 3 x Din x I x 2 B = 18.9 MB on `mini` (~4.5 us at 4.2 TB/s). The sum over slots
has a fixed order and no atomics: the output is deterministic. Rounding follows the reference: gate and up in
x's dtype, the activation in fp32, h in x's dtype, each expert's output in x's dtype (y holds it so) before the
fp32 weighted sum; with a shared expert, the routed sum rounded to x's dtype, plus the shared output, rounded
again (the layer's `routed + shared` in x's dtype).

Measured on the H200 (2026-11-30, `mini`'s sizes, bf16, one CUDA graph of 24 calls on 24 layers' weights, us per
call; Triton with the tiles of `_tiles`, T=8..4096 with an earlier, slower gate_up tile):
    T          1     8     64    170   256   1024   4096
    grouped    72    116   176   196   209   405    1077
    Triton     30    60    101   110   111   214    491
T = 1 is far above its 4.5 us of bytes (not yet profiled: six or more small launches, torch.sort and
searchsorted included then, before `sort_pairs`, and few programs in flight); T = 64 reads every expert
once (201 MB, 47 us at 4.2 TB/s).

ids outside [0, E) (another rank's experts under EP) fall in no block and add nothing. Inference only: no
autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.activation.triton_act import glu
from kestrel.ops.pdl import pdl_args, pdl_begin

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _expert_block(starts, E, M, S, BLOCK_M: tl.constexpr, EP: tl.constexpr):
    """Program b's expert e and its rows [row0, row_end): the routed experts' blocks first, over the sorted
    rows; then the shared expert's (e == E) over rows M..M + S - 1. row0 >= row_end past the last block."""
    b = tl.program_id(0)
    es = tl.arange(0, EP)
    lo = tl.load(starts + es, mask=es < E, other=0)  # [EP] first sorted row of each expert
    hi = tl.load(starts + es + 1, mask=es < E, other=0)  # [EP] one past its last
    nb = (hi - lo + BLOCK_M - 1) // BLOCK_M  # [EP] blocks of each expert (none for the padding)
    cum = tl.cumsum(nb, axis=0)  # [EP] blocks up to and including each expert
    e = tl.sum((cum <= b).to(tl.int32), axis=0)  # experts whose blocks all come before b
    here = es == e
    first_block = tl.sum(tl.where(here, cum - nb, 0), axis=0)
    row0 = tl.sum(tl.where(here, lo, 0), axis=0) + (b - first_block) * BLOCK_M
    row_end = tl.sum(tl.where(here, hi, 0), axis=0)
    total = tl.sum(nb, axis=0)  # the routed experts' blocks
    routed = b < total
    e = tl.where(routed, e, E)
    row0 = tl.where(routed, row0, M + (b - total) * BLOCK_M)
    row_end = tl.where(routed, row_end, M + S)
    return e, row0, row_end


@triton.jit
def _rounded(v, dtype: tl.constexpr, BF16: tl.constexpr):
    """fp32 v rounded to dtype (nearest, ties to even), kept in fp32. bf16 by hand, the same on GPU and CPU:
    Triton's interpreter truncates bf16 casts, and the tests compare against torch's rounding."""
    if BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # NaN kept (the carry could clear it)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit
def _gate_up_kernel(
    x,
    w13,
    ws13,
    order,
    starts,
    h,
    M,
    S,
    Din,
    I,
    E,
    A,
    beta,
    linear_beta,
    SITU: tl.constexpr,
    BF16: tl.constexpr,
    CAST_W: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    e, row0, row_end = _expert_block(starts, E, M, S, BLOCK_M, EP)
    if row0 >= row_end:
        return
    shared = e == E
    rows = row0 + tl.arange(0, BLOCK_M)  # [BM] sorted rows (the shared expert's: M + token)
    live = rows < row_end
    pair = tl.load(order + rows, mask=live & (rows < M), other=0)  # [BM]
    token = tl.where(shared, rows - M, pair // A)  # [BM]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate units
    cmask = cols < I
    x_rows = x + token[:, None].to(tl.int64) * Din  # [BM, 1]
    w_e = tl.where(shared, ws13, w13 + e.to(tl.int64) * 2 * I * Din)  # this expert's [2I, Din]
    w_gate = w_e + cols[:, None].to(tl.int64) * Din  # [BN, 1]
    w_up = w_gate + I * Din
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, Din, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < Din
        xt = tl.load(x_rows + ks[None, :], mask=live[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
        wmask = cmask[:, None] & kmask[None, :]
        g = tl.load(w_gate + ks[None, :], mask=wmask, other=0.0)  # [BN, BK]
        u = tl.load(w_up + ks[None, :], mask=wmask, other=0.0)  # [BN, BK]
        if CAST_W:  # weights in another dtype: rounded to x's, as the reference's w13.to(x.dtype)
            g = _rounded(g.to(tl.float32), x.dtype.element_ty, BF16).to(x.dtype.element_ty)
            u = _rounded(u.to(tl.float32), x.dtype.element_ty, BF16).to(x.dtype.element_ty)
        if DOT_F32:
            xt, g, u = xt.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(xt, tl.trans(g), acc=acc_g, input_precision=PRECISION)  # [BM, BN]
        acc_u = tl.dot(xt, tl.trans(u), acc=acc_u, input_precision=PRECISION)  # [BM, BN]
    # as the reference rounds: gate and up in x's dtype, the activation in fp32
    gate = _rounded(acc_g, x.dtype.element_ty, BF16)
    up = _rounded(acc_u, x.dtype.element_ty, BF16)
    act = glu(gate, up, beta, linear_beta, SITU)
    out = h + rows[:, None].to(tl.int64) * I + cols[None, :]
    act = _rounded(act, h.dtype.element_ty, BF16)
    tl.store(out, act.to(h.dtype.element_ty), mask=live[:, None] & cmask[None, :])


@triton.jit
def _down_kernel(
    h,
    w2,
    ws2,
    order,
    starts,
    y,
    M,
    S,
    Din,
    I,
    E,
    BF16: tl.constexpr,
    CAST_W: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    e, row0, row_end = _expert_block(starts, E, M, S, BLOCK_M, EP)
    if row0 >= row_end:
        return
    shared = e == E
    rows = row0 + tl.arange(0, BLOCK_M)  # [BM] sorted rows
    live = rows < row_end
    # [BM] y's row: the pair t * A + a, or for the shared expert M + t (its row of h)
    pair = tl.where(shared, rows, tl.load(order + rows, mask=live & (rows < M), other=0))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output units
    cmask = cols < Din
    h_rows = h + rows[:, None].to(tl.int64) * I  # [BM, 1]
    w_e = tl.where(shared, ws2, w2 + e.to(tl.int64) * Din * I)  # this expert's [Din, I]
    w_rows = w_e + cols[:, None].to(tl.int64) * I  # [BN, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < I
        ht = tl.load(h_rows + ks[None, :], mask=live[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_rows + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)  # [BN, BK]
        if CAST_W:
            w = _rounded(w.to(tl.float32), h.dtype.element_ty, BF16).to(h.dtype.element_ty)
        if DOT_F32:
            ht, w = ht.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(ht, tl.trans(w), acc=acc, input_precision=PRECISION)  # [BM, BN]
    val = _rounded(acc, y.dtype.element_ty, BF16)  # the expert's output in x's dtype, as the reference
    tl.store(
        y + pair[:, None].to(tl.int64) * Din + cols[None, :],
        val.to(y.dtype.element_ty),
        mask=live[:, None] & cmask[None, :],
    )


@triton.jit
def _place_block(ids, order, off, M, E, es, start, BLOCK: tl.constexpr):
    """Write the pairs off..off + BLOCK - 1 of each expert e to their sorted rows, from row start[e] on, in pair
    order (one [BLOCK, EP] one-hot scan); returns how many pairs of each expert the block held [EP]."""
    p = off + tl.arange(0, BLOCK)
    live = p < M
    v = tl.load(ids + p, mask=live, other=-1).to(tl.int32)  # [BLOCK]
    mine = (v[:, None] == es[None, :]) & live[:, None] & (v[:, None] < E)  # [BLOCK, EP] one-hot
    onehot = mine.to(tl.int32)
    rank = tl.sum(tl.where(mine, tl.cumsum(onehot, 0) + start[None, :], 0), 1)  # [BLOCK]
    tl.store(order + rank - 1, p.to(tl.int64), mask=live & (v >= 0) & (v < E))
    return tl.sum(onehot, 0)


@triton.jit
def _sort_pairs_kernel(
    ids, order, starts, M, E, EP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    """One program: a stable counting sort of the M pair ids by expert. starts[e] (e = 0..E) is the first
    sorted row of expert e (the ids below 0 come first, as in a sort), order[starts[e] + j] the pair of
    expert e's j-th pair in pair order. Rows of out-of-range ids are left unwritten: no block reads them."""
    pdl_begin(PDL)
    es = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    below = tl.zeros([EP], dtype=tl.int32)  # ids < 0, counted in every lane (a vector: a loop-carried value)
    for off in range(0, M, BLOCK):
        p = off + tl.arange(0, BLOCK)
        live = p < M
        v = tl.load(ids + p, mask=live, other=0).to(tl.int32)  # [BLOCK]
        counts += tl.histogram(v, EP, mask=live & (v >= 0) & (v < E))
        below += tl.sum((live & (v < 0)).to(tl.int32), 0)
    first = below + tl.cumsum(counts, 0) - counts  # [EP] first sorted row of each expert
    tl.store(starts + es, first, mask=es < E)
    tl.store(starts + E + es, below + tl.sum(counts, 0), mask=es == 0)
    taken = tl.zeros([EP], dtype=tl.int32)  # pairs of each expert placed so far
    for off in range(0, M, BLOCK):
        taken += _place_block(ids, order, off, M, E, es, first + taken, BLOCK)


@triton.jit
def _sort_pairs_blocks_kernel(
    ids,
    order,
    starts,
    M,
    E,
    EP: tl.constexpr,
    MP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`_sort_pairs_kernel`'s sort with one program per block of BLOCK pairs instead of one for all: each program
    histograms all M ids (MP >= M, one load) for the experts' first rows and, from the ids before its block,
    where each expert's pairs of its block start; then ranks its block's pairs in one [BLOCK, EP] one-hot scan.
    Program 0 writes starts. Same outputs (rows of out-of-range ids left unwritten)."""
    pdl_begin(PDL)
    b = tl.program_id(0)
    es = tl.arange(0, EP)
    q = tl.arange(0, MP)
    every = q < M
    v = tl.load(ids + q, mask=every, other=0).to(tl.int32)  # [MP] all the ids
    valid = every & (v >= 0) & (v < E)
    counts = tl.histogram(v, EP, mask=valid)  # [EP]
    earlier = tl.histogram(v, EP, mask=valid & (q < b * BLOCK))  # [EP] pairs of each expert before the block
    below = tl.sum((every & (v < 0)).to(tl.int32), 0)
    first = below + tl.cumsum(counts, 0) - counts  # [EP] first sorted row of each expert
    if b == 0:
        tl.store(starts + es, first, mask=es < E)
        tl.store(starts + E + es, below + tl.sum(counts, 0) + tl.zeros([EP], dtype=tl.int32), mask=es == 0)
    _place_block(ids, order, b * BLOCK, M, E, es, first + earlier, BLOCK)


# Up to this many pairs a Triton counting sort places them (one launch instead of torch.sort, arange and
# searchsorted); past it torch.sort. Timed in CUDA graphs of 24 calls on the H200 (scripts/decode_kernels_check.py,
# 2026-12-01, session 20), us a call, one program / a program per block / torch.sort + searchsorted:
#   64 experts:  M=6 2.2 / 2.0 / 13.3;  M=96 4.1 / 5.3 / 15.9;  M=384 8.8 / 5.5 / 32.9;  M=1536 24.3 / 6.8 / 35.5
#   384 experts: M=8 3.6 / 4.0 / 13.3;  M=512 48.9 / 4.7 / 33.3;  M=2048 190.5 / 7.9 / 36.3
# So a program per block past 128 pairs at 64 experts (16 at 384), the one-program sort up to there. In mini's
# batch-256 step (1536 pairs, 24 calls, `bench decode --profile`) 0.87 ms -> 0.51 ms: 19 us a call there, beside
# the shared experts' side stream, against 6.9 us alone. Session 22 swept the per-block sort's block
# and warps at 64 experts (`small_kernels`): 32 pairs a block and 8 warps took M=1536 from 6.9 to 3.6 us, M=384
# from 5.5 to 2.6 (128 pairs a block, 4 warps, before); more programs, each ranking fewer pairs.
COUNTING_SORT_MAX_PAIRS = 2048


def sort_pairs(ids: torch.Tensor, E: int, parallel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [M] int64, starts [E + 1] int32) of the flattened pair ids [M]: the pairs of expert e are
    order[starts[e]:starts[e + 1]], in pair order (a stable sort by expert). Up to COUNTING_SORT_MAX_PAIRS a
    counting sort: parallel=True a program per block of pairs (`_sort_pairs_blocks_kernel`), False one program
    for all (`_sort_pairs_kernel`), None the first past min(8192 / EP, 128) pairs (EP: E to a power of two)."""
    flat = ids.reshape(-1)
    M = flat.numel()
    if M == 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device), flat.new_zeros(E + 1, dtype=torch.int32)
    if M <= COUNTING_SORT_MAX_PAIRS:
        order = torch.empty(M, dtype=torch.int64, device=flat.device)
        starts = torch.empty(E + 1, dtype=torch.int32, device=flat.device)
        ep, mp = triton.next_power_of_2(E), triton.next_power_of_2(M)
        block = min(max(16, 2048 // ep), 128, mp)  # a program per block: a [block, ep] one-hot tile each
        if parallel is None:  # session 20's dispatch: one program up to 8192 / EP pairs (128 at 64 experts)
            parallel = M > min(max(16, 8192 // ep), 128)
        if parallel:
            grid = (triton.cdiv(M, block),)
            _sort_pairs_blocks_kernel[grid](
                flat, order, starts, M, E, EP=ep, MP=mp, BLOCK=block, num_warps=8, **pdl_args(order)
            )
        else:
            block = min(max(16, 16384 // ep), 256, mp)  # a [block, ep] one-hot tile
            _sort_pairs_kernel[(1,)](
                flat, order, starts, M, E, EP=ep, BLOCK=block, num_warps=8, **pdl_args(order)
            )
        return order, starts
    sorted_ids, order = torch.sort(flat, stable=True)  # [M], [M] expert-major, then pair order
    bounds = torch.arange(E + 1, device=flat.device, dtype=flat.dtype)  # [E + 1]
    return order, torch.searchsorted(sorted_ids, bounds, out_int32=True)  # [E + 1] first sorted row of each


@triton.jit
def _moe_combine_kernel(
    y,
    rows,
    ids,
    weights,
    out,
    M,
    Din,
    E,
    A: tl.constexpr,
    SORTED: tl.constexpr,
    SHARED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[t] = sum over slots a, in slot order, of weights[t * A + a] times pair (t, a)'s row of y: row
    t * A + a (the Triton path), or with SORTED row rows[t * A + a] (the grouped path's expert-major rows).
    Pairs with an id outside [0, E) add nothing (their rows were never computed). SHARED: the sum rounded to
    out's dtype, plus row M + t (the shared expert's output), rounded again. ACCUMULATE: out[t] += that, rounded
    once more (torch's `out.add_(result)` in out's dtype)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cmask = cols < Din
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for a in tl.static_range(A):  # slot order: a fixed sum
        e = tl.load(ids + t * A + a)
        ok = (e >= 0) & (e < E)
        if SORTED:
            r = tl.where(ok, tl.load(rows + t * A + a).to(tl.int64), 0)  # row 0: read, then dropped
        else:
            r = t * A + a
        w = tl.load(weights + t * A + a).to(tl.float32)
        row = tl.load(y + r * Din + cols, mask=cmask, other=0.0).to(tl.float32)  # [BN]
        acc += tl.where(ok, row * w, 0.0)
    if SHARED:
        shared = tl.load(y + (M + t) * Din + cols, mask=cmask, other=0.0).to(tl.float32)  # [BN]
        acc = _rounded(acc, out.dtype.element_ty, BF16) + shared
    if ACCUMULATE:
        before = tl.load(out + t * Din + cols, mask=cmask, other=0.0).to(tl.float32)  # [BN]
        acc = _rounded(acc, out.dtype.element_ty, BF16) + before
    acc = _rounded(acc, out.dtype.element_ty, BF16)
    tl.store(out + t * Din + cols, acc.to(out.dtype.element_ty), mask=cmask)


def _combine(
    y, rows, ids, weights, out, E: int, sorted_rows: bool, shared: bool = False, accumulate: bool = False,
    block_n: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Columns in blocks of block_n a program (None: 256 up to 64 tokens, else 512; on the H200 at mini's 2048,
    in CUDA graphs of 24 calls with the shared rows and the residual add, session 22: 1.75 / 2.15 / 3.39 us a
    call at 1 / 64 / 256 tokens, against 2.62 / 2.87 / 3.74 with blocks of 1024)."""
    T, A = ids.shape
    Din = out.shape[1]
    if T:
        block = min(block_n or (256 if T <= 64 else 512), triton.next_power_of_2(Din))
        _moe_combine_kernel[(T, triton.cdiv(Din, block))](
            y, rows, ids, weights, out, T * A, Din, E, A=A, SORTED=sorted_rows, SHARED=shared,
            ACCUMULATE=accumulate, BF16=out.dtype == torch.bfloat16, BLOCK_N=block, **pdl_args(out),
        )  # fmt: skip
    return out


def combine_sorted(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, E: int
) -> torch.Tensor:
    """out[t] = sum_a weights[t, a] * y[row of pair (t, a)] in fp32, slot order, rounded once to y's dtype:
    the end of the grouped path (kestrel.ops.moe.grouped), whose expert outputs y [M, Din] sit in expert-major
    order (sorted row i holds pair order[i]). One read of y and one write of out, where the torch form makes an
    fp32 copy, a weighted copy, a scatter back to pair order and a sum (about 3 ms a layer for 32K tokens at
    top-6 on mini). Pairs with ids outside [0, E) add nothing. Inference only: no autograd."""
    T, A = ids.shape
    M, Din = y.shape
    assert order.shape == (M,) and M == T * A and weights.shape == (T, A), "y, order, weights, ids disagree"
    y, ids, weights = y.contiguous(), ids.contiguous(), weights.contiguous()
    rows = torch.empty_like(order)
    rows[order] = torch.arange(M, device=order.device, dtype=order.dtype)  # pair -> its sorted row
    out = torch.empty(T, Din, dtype=y.dtype, device=y.device)
    return _combine(y, rows, ids, weights, out, E, sorted_rows=True)


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized intermediates (h, y); tests fill them with NaN to show every element read was written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tiles(M: int, E: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(block_m, block_n, block_k) from the shapes only. block_m ~ the mean pairs per expert, 16 (the smallest
    tl.dot) to 64. The rest from a sweep on the H200 at `mini`'s sizes (CUDA graphs, 2026-11-30): with one block per
    expert, gate_up is a few programs each streaming a [32, Din] slice, where long K steps keep more bytes in
    flight (T=1: 30 us a layer at BK=256, 37 at 64); with more pairs per block (64, 128) did best. The down
    tiles moved the time by under 2 %. Session 20's sweep (scripts/decode_kernels_check.py, 8 layers' weights in
    one graph): T=1 kept 16 / 32 / 256 (19.4 us a layer, the best of 54); T=256 (block_m 32) took gate_up's
    BK=64 over 128: 99.5 us a layer against 104.7 (block_m 64, prefill, keeps 128). Session 21 swept gate_up's
    and down's knobs apart, pipeline depths included, with the shared expert in the launches: nothing beat these
    by more than 5% (T=256: 80.1 us a layer, the best, against 47.8 us of bytes)."""
    bm = min(64, max(16, triton.next_power_of_2(triton.cdiv(M, E))))
    return bm, (32 if bm == 16 else 64, 64), ({16: 256, 32: 64}.get(bm, 128), 64)


def moe_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: tuple[int, int] | None = None,
    block_k: tuple[int, int] | None = None,
    num_warps: int = 4,
    sorted_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_stages: tuple[int, int] | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """`naive.moe_experts` (same arguments, same result up to rounding order) without host syncs.

    x [T, Din] (bf16, fp16 or fp32); w13 [E, 2I, Din]; w2 [E, Din, I] (cast to x's dtype tile by tile);
    weights [T, A]; ids [T, A]; act 'silu' or 'situ'. block_n, block_k and num_stages are (gate_up, down)
    tiles and software-pipeline depths, block_m the pairs per block (None: `_tiles`, Triton's default depth);
    sorted_pairs: `sort_pairs(ids, E)` already computed. shared: a shared
    expert's (ws13 [2I, Din], ws2 [Din, I]) in w13's dtype, which every token takes: the result is then the
    routed experts' output plus the shared expert's, each rounded to x's dtype and the sum once more (the MoE
    layer's `routed + shared_experts(x)`). accumulate: out (given) += the result, rounded as torch's
    `out.add_(result)` (the layer's residual add, without its own kernel). Returns out [T, Din] in x.dtype,
    accumulated in fp32.
    """
    T, A = ids.shape
    E, two_i, Din = w13.shape
    I = two_i // 2
    assert x.shape == (T, Din) and weights.shape == (T, A), (
        f"x {tuple(x.shape)}, weights {tuple(weights.shape)}"
    )
    assert w2.shape == (E, Din, I) and two_i == 2 * I, f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    assert x.dtype in _DTYPES, f"x dtype {x.dtype}"
    if act not in ("silu", "situ"):
        raise ValueError(f"unknown activation {act!r}")
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()
    if shared is not None:
        ws13, ws2 = (w.contiguous() for w in shared)
        assert ws13.shape == (2 * I, Din) and ws2.shape == (Din, I), (
            f"shared expert {tuple(ws13.shape)}, {tuple(ws2.shape)}: needs the routed experts' width"
        )
        assert ws13.dtype == ws2.dtype == w13.dtype == w2.dtype, (
            "shared and routed experts' weights: one dtype"
        )
    else:
        ws13, ws2 = w13, w2  # not read: no shared blocks
    if out is None:
        assert not accumulate, "accumulate adds into a given out"
        out = torch.empty(T, Din, dtype=x.dtype, device=x.device)
    assert out.shape == (T, Din) and out.dtype == x.dtype and out.is_contiguous()
    M = T * A
    S = T if shared is not None else 0
    if M + S == 0:
        return out if accumulate else out.zero_()

    if sorted_pairs is None:
        sorted_pairs = sort_pairs(ids, E)
    order, starts = sorted_pairs  # [M], [E + 1]
    assert order.shape == (M,) and starts.shape == (E + 1,), "sorted_pairs: (order [T * A], starts [E + 1])"
    h = _scratch((M + S, I), x.dtype, x.device)  # [M + S, I] in sorted order, then the shared expert's rows
    y = _scratch((M + S, Din), x.dtype, x.device)  # [M + S, Din] in pair order, then the shared expert's rows

    bm, tile_n, tile_k = _tiles(M, E)
    bm, block_n, block_k = block_m or bm, block_n or tile_n, block_k or tile_k
    blocks = min(M, M // bm + E) + triton.cdiv(S, bm)  # >= sum_e cdiv(count_e, bm) + the shared blocks
    # The CPU interpreter's tl.dot misreads bf16 (kestrel.ops.mla.triton_decode): fp32 operands there.
    dot_f32 = x.dtype == torch.float32 or not x.is_cuda
    common = dict(
        BF16=x.dtype == torch.bfloat16,
        CAST_W=w13.dtype != x.dtype or w2.dtype != x.dtype,
        DOT_F32=dot_f32,
        PRECISION="ieee" if dot_f32 else "tf32",  # exact fp32 products; ignored for 16-bit operands
        BLOCK_M=bm,
        EP=triton.next_power_of_2(E),
        num_warps=num_warps,
        **pdl_args(x),
    )
    _gate_up_kernel[(blocks, triton.cdiv(I, block_n[0]))](
        x,
        w13,
        ws13,
        order,
        starts,
        h,
        M,
        S,
        Din,
        I,
        E,
        A,
        float(situ_beta),
        float(situ_linear_beta),
        SITU=act == "situ",
        BLOCK_N=block_n[0],
        BLOCK_K=block_k[0],
        **common,
        **({} if num_stages is None else {"num_stages": num_stages[0]}),
    )
    _down_kernel[(blocks, triton.cdiv(Din, block_n[1]))](
        h, w2, ws2, order, starts, y, M, S, Din, I, E, BLOCK_N=block_n[1], BLOCK_K=block_k[1], **common,
        **({} if num_stages is None else {"num_stages": num_stages[1]}),
    )  # fmt: skip
    # (rows unused: ids stands in)
    return _combine(
        y, ids, ids, weights, out, E, sorted_rows=False, shared=shared is not None, accumulate=accumulate
    )
