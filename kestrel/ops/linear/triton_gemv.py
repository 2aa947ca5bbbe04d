"""y = x W^T for a few rows (decode's projections) in Triton: `naive.linear_reference`'s result up to the
order of the fp32 sums.

Legend: M rows of x (at most 16), N output features, K input features; BN weight rows a program, BK a step.
Program n owns the output columns n * BN .. n * BN + BN - 1 for every row: it streams its [BN, K] slice of W
(contiguous in memory) once, in BK-wide tiles, each multiplied against x's [M, BK] tile (tl.dot, M padded to
16, fp32 accumulation), and writes [M, BN] rounded once. With PDL (kestrel.ops.pdl) the program first lets
the next kernel launch, then asks for its whole weight slice into L2 (one bulk prefetch a row), and only then
waits for the kernel before it: weights do not depend on it, so they stream in while it ends, and the loop
reads them from L2.

The rows kernel (`_gemv_rows_kernel`, session 55; up to ROWS_MAX_M rows, K up to ROWS_MAX_K): the K loop above
waits on each step's load before the next goes out (Triton does not pipeline it: no cp.async in its sm_90 PTX),
which fits what session 52 measured on the H200 at batch 1 (mini's KDA projections 11.15 us a layer from HBM, 10.08
with the weights already in L2, 5.04 of bytes: latency, not bandwidth; the rows kernel below took 30% off it). The rows
kernel loads a program's whole [BN, K] slice at once, before the PDL wait, and sums each row's products in fp32 (no
tl.dot): one round trip, overlapped with the kernel before. It was first checked in Triton's interpreter and
compiled for sm_90 on the CPU (`scripts/triton_sm90_check.py --div`: K and the pointers multiples of 16, as Triton
specializes them at launch; BN 8 at 8 warps 48 registers, its slice as eight 16-byte loads a thread, all before
`griddepcontrol.wait`; BN 16 at 8 warps 80; BN 32 255, spilling at 4 warps). Timed on an H100 in session 56
(`scripts/gpu_calls.py rows gemvab`; bench/results/2026-12-05-h100-session56.json): mini's KDA projections at
batch 1 9.0 us a layer against the K loop's 12.9 (floor 7.1), 2 rows 11.3-11.8 against 14.4, 4 rows 15.5-16.9
against 14.5; the batch-1 decode step 1.458 ms against 1.550. So by default (KESTREL_GEMV=auto) it takes up to
ROWS_AUTO_M rows, KESTREL_GEMV=rows up to ROWS_MAX_M, dot none. It can also take the op before it (the o
projections' output gates, `gate=`) and the op after it (KDA's conv step, `conv=`): KESTREL_GEMV_FUSE.

One launch may take several weights of one input (`gemv_many_triton`, up to GEMV_MAX_WEIGHTS): their slices are the
grid's programs one weight after another, and each program picks its weight, output and width from its index.
A small projection alone costs a whole launch (4-5 us at batch 1 however few its bytes); side by side they cost
their bytes.

Where it runs: `kestrel.ops.linear.linear`, from every `Linear` layer at inference up to GEMV_MAX_ROWS rows
where PDL is on (`gemv_applies`), and `linear_many` (MLA's projections of its input). cuBLAS's kernels for one
row read mini's projections at a fraction of the copy rate (84 calls of ~5 us at batch 1 in session 19's
profile, for 0.30 ms of weights at the copy rate) and cannot launch with PDL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.env import env_field
from kestrel.ops.kda.triton_conv import conv_window_step
from kestrel.ops.linear import GEMV_MAX_WEIGHTS as SEGMENTS
from kestrel.ops.norm.triton_norm import row_align
from kestrel.ops.pdl import l2_prefetch, pdl_args, pdl_launch_next, pdl_wait


@triton.jit
def _pick(pid, seg_first, seg_w, seg_out, seg_n, first, w, out, N):
    """Segment s's weight, output and width where program `pid` is at or past its first program."""
    take = pid >= seg_first
    return (
        tl.where(take, seg_first, first),
        tl.where(take, seg_w, w),
        tl.where(take, seg_out, out),
        tl.where(take, seg_n, N),
    )


@triton.jit
def _segment(
    pid, w0, out0, n0, w1, out1, n1, w2, out2, n2, w3, out3, n3, w4, out4, n4, w5, out5, n5,
    first1, first2, first3, first4, first5, SEGS: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Program pid's segment (segment 0 from program 0, the later ones from first1, ...): its weight, output and
    width, and the program's BN output features in it (weight rows)."""
    first, w, out, N = pid * 0, w0, out0, n0
    if SEGS > 1:
        first, w, out, N = _pick(pid, first1, w1, out1, n1, first, w, out, N)
    if SEGS > 2:
        first, w, out, N = _pick(pid, first2, w2, out2, n2, first, w, out, N)
    if SEGS > 3:
        first, w, out, N = _pick(pid, first3, w3, out3, n3, first, w, out, N)
    if SEGS > 4:
        first, w, out, N = _pick(pid, first4, w4, out4, n4, first, w, out, N)
    if SEGS > 5:
        first, w, out, N = _pick(pid, first5, w5, out5, n5, first, w, out, N)
    return w, out, N, (pid - first) * BN + tl.arange(0, BN)


@triton.jit
def _gemv_kernel(
    x, M, K, stride_xm,
    w0, out0, n0, w1, out1, n1, w2, out2, n2, w3, out3, n3, w4, out4, n4, w5, out5, n5,
    first1, first2, first3, first4, first5,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    SEGS: tl.constexpr = 1, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    w, out, N, cols = _segment(
        tl.program_id(0), w0, out0, n0, w1, out1, n1, w2, out2, n2, w3, out3, n3, w4, out4, n4, w5, out5, n5,
        first1, first2, first3, first4, first5, SEGS, BN,
    )  # fmt: skip
    nmask = cols < N
    w_rows = w + cols[:, None].to(tl.int64) * K  # [BN, 1]
    pdl_launch_next(PDL)
    if PREFETCH:  # this slice's rows (PREFETCH bytes each) into L2 before the wait: no kernel writes weights
        l2_prefetch(w + tl.minimum(cols, N - 1).to(tl.int64) * K, PREFETCH)
    pdl_wait(PDL)
    m = tl.arange(0, BM)
    mmask = m < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        xt = tl.load(
            x + m[:, None] * stride_xm + ks[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
        )
        wt = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BN, BK]
        if DOT_F32:
            xt, wt = xt.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc=acc, input_precision=PRECISION)  # [BM, BN]
    tl.store(  # each output is a fresh [M, N] of its segment
        out + m[:, None] * N + cols[None, :],
        acc.to(out.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


@triton.jit
def _gated_row(xv, gate, norm_w, ks, kmask, eps, dt: tl.constexpr, GATE: tl.constexpr, G: tl.constexpr,
               KP: tl.constexpr):  # fmt: skip
    """A row of x [KP] fp32 through its output gate, rounded to dt as the gate's own op leaves it: GATE 1
    x * sigmoid(gate) (MLA: the sigmoid rounded to dt, then the product); 2 RMSNorm over each group of G columns,
    times norm_w [G] and sigmoid(gate), in fp32 (KDA's per-head norm-gate)."""
    gv = tl.load(gate + ks, mask=kmask, other=0.0).to(tl.float32)
    if GATE == 1:
        y = xv * tl.sigmoid(gv).to(dt).to(tl.float32)
    else:
        groups = tl.reshape(xv, (KP // G, G))
        inv = tl.rsqrt(tl.sum(groups * groups, axis=1) / G + eps)  # [KP // G]
        normed = tl.reshape(groups * inv[:, None], (KP,))
        y = tl.load(norm_w + ks % G).to(tl.float32) * normed * tl.sigmoid(gv)
    return y.to(dt).to(tl.float32)


@triton.jit
def _gemv_rows_kernel(
    x, K, stride_xm,
    w0, out0, n0, w1, out1, n1, w2, out2, n2, w3, out3, n3, w4, out4, n4, w5, out5, n5,
    first1, first2, first3, first4, first5, gate, gm_units, norm_w, eps,
    conv_w, pool, slots, planes, C, PC, stride_ps, stride_pc, blocks,
    M: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, SEGS: tl.constexpr = 1, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = True, GATE: tl.constexpr = 0, G: tl.constexpr = 1, G_ALIGN: tl.constexpr = 1,
    CONV: tl.constexpr = False, W: tl.constexpr = 1, WP: tl.constexpr = 1, PERSIST: tl.constexpr = False,
):  # fmt: skip
    """A few rows (M constexpr, decode at batch 1 to 4): program n's whole [BN, K] slice of W in one load, so all
    its bytes are in flight at once (the K loop of `_gemv_kernel` waits on each step's load in turn: Triton does
    not pipeline it). With EARLY and PDL the load is issued before the wait for the kernel in front (weights
    depend on no kernel): they arrive while it ends. Then x's rows (with GATE, each through its output gate
    first: `_gated_row`), and each row's products summed in fp32; with CONV, output columns below C also go
    through KDA's short-conv decode step (`_conv_columns`). With PERSIST the grid is smaller than the `blocks`
    slices: a program walks blocks pid, pid + grid, ..., each next slice's load issued before this one's sums."""
    args = (w0, out0, n0, w1, out1, n1, w2, out2, n2, w3, out3, n3, w4, out4, n4, w5, out5, n5,
            first1, first2, first3, first4, first5)  # fmt: skip
    pid = tl.program_id(0)
    ks = tl.arange(0, KP)
    kmask = ks < K
    w, out, N, cols = _segment(pid, *args, SEGS, BN)
    pdl_launch_next(PDL)
    if EARLY:
        wt = _rows_slice(w, N, cols, ks, kmask, K, pid < blocks)  # [BN, KP]
        pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        wt = _rows_slice(w, N, cols, ks, kmask, K, pid < blocks)
    if PERSIST:
        nprog = tl.num_programs(0)
        for b in range(pid, blocks, nprog):
            nb = b + nprog  # the next slice's loads out before this one's sums
            w_n, out_n, N_n, cols_n = _segment(tl.minimum(nb, blocks - 1), *args, SEGS, BN)
            wt_n = _rows_slice(w_n, N_n, cols_n, ks, kmask, K, nb < blocks)
            _rows_sums(
                wt, x, stride_xm, ks, kmask, out, N, cols, gate, gm_units, norm_w, eps, conv_w, pool, slots,
                planes, C, PC, stride_ps, stride_pc, M, KP, GATE, G, G_ALIGN, CONV, W, WP,
            )  # fmt: skip
            wt, out, N, cols = wt_n, out_n, N_n, cols_n
    else:
        _rows_sums(
            wt, x, stride_xm, ks, kmask, out, N, cols, gate, gm_units, norm_w, eps, conv_w, pool, slots, planes, C,
            PC, stride_ps, stride_pc, M, KP, GATE, G, G_ALIGN, CONV, W, WP,
        )  # fmt: skip


@triton.jit
def _rows_slice(w, N, cols, ks, kmask, K, live):
    """A program's weight slice [BN, KP]: rows cols of w [N, K] (nothing read where not live)."""
    mask = (cols < tl.where(live, N, 0))[:, None] & kmask[None, :]
    return tl.load(w + cols[:, None].to(tl.int64) * K + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _rows_sums(
    wt, x, stride_xm, ks, kmask, out, N, cols, gate, gm_units, norm_w, eps, conv_w, pool, slots, planes, C, PC,
    stride_ps, stride_pc, M: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr, G: tl.constexpr,
    G_ALIGN: tl.constexpr, CONV: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
):  # fmt: skip
    """Each of x's M rows (through its gate with GATE) times the slice wt, into out's columns cols (and through
    the conv step with CONV)."""
    nmask = cols < N
    for m in tl.static_range(M):
        xv = tl.load(x + m * stride_xm + ks, mask=kmask, other=0.0).to(tl.float32)  # [KP]
        if GATE:
            # the gate's row stride is gm_units * G_ALIGN: a known multiple, so its rows load as vectors
            xv = _gated_row(
                xv, gate + m * gm_units * G_ALIGN, norm_w, ks, kmask, eps, x.dtype.element_ty, GATE, G, KP
            )
        acc = tl.sum(wt.to(tl.float32) * xv[None, :], axis=1)  # [BN]
        tl.store(out + m * N + cols, acc.to(out.dtype.element_ty), mask=nmask)
        if CONV:
            _conv_columns(
                acc.to(out.dtype.element_ty).to(tl.float32), cols, nmask & (cols < C), m, M, conv_w, pool,
                slots, planes, PC, stride_ps, stride_pc, W, WP,
            )  # fmt: skip


@triton.jit
def _conv_columns(xq, cols, cmask, m, M: tl.constexpr, conv_w, pool, slots, planes, PC, stride_ps, stride_pc,
                  W: tl.constexpr, WP: tl.constexpr):  # fmt: skip
    """KDA's short-conv decode step (kestrel.ops.kda.triton_conv.conv_window_step, its kernel's own code) on row
    m's new inputs xq [BN] (the projection's output as stored) in channels cols: SiLU(conv over [window | xq])
    into planes [C // PC, M, PC], and the slot's window [C, W - 1] in pool shifted by xq."""
    slot = tl.load(slots + m).to(tl.int64)
    y = conv_window_step(xq, cols, cmask, slot, conv_w, pool, stride_ps, stride_pc, W, WP)
    tl.store(planes + (cols // PC) * M * PC + m * PC + cols % PC, y.to(planes.dtype.element_ty), mask=cmask)


# Launch knobs from a sweep on the H200 (session 23, 2026-12-01; its configurations and times are in
# bench/results/2026-12-01-h200-session23.json): mini's projections after an RMSNorm, 24 layers' weights in one
# CUDA graph, block_n 16 / 32 / 64 x block_k 128 / 256 x 2-4 stages x prefetch on / off. 64 weight rows a program
# (32 below 2048 outputs: more programs), 256-wide steps, 4 stages; the L2 prefetch paid up to 8 MB of weights
# (2048 x 1024 at batch 1: 4.6 against 5.4 us without) and cost above (3072 x 2048 at batch 1: 8.5 against 7.8).
# Swept again in session 41 (2026-12-04, .session script in bench/results/2026-12-04-h200-session41.json) on the
# step's projections at batch 1 and 16 (KDA's q|k|v|f_a|b|g 4232 x 2048, MLA's six merged 7888 x 2048, the o
# projections, KDA's f_b), block_n 16-128 x 4 / 8 warps x prefetch on / off: these defaults were the best or within
# 0.02 us of it on every shape (e.g. the six merged at batch 1 11.05 us, 8 warps 16.45, block_n 32 22.3).
# Tried and dropped (session 44, mini at 4K on the H200): the output projections making their gated input in the
# loop (MLA's x * sigmoid(gate), KDA's gated RMSNorm over each head, from each K step's tile of x and of the gate),
# 24 launches a step fewer, yet the replayed step was slower: batch 1 1.583-1.587 ms against 1.422 with the gates'
# own launches, batch 4 2.250-2.266 against 1.925.
PREFETCH_MAX_BYTES = 8 << 20


# The rows kernel (`_gemv_rows_kernel`): up to ROWS_MAX_M rows and K up to ROWS_MAX_K (padded to a power of
# two), a program's whole slice in one load of ROWS_TILE weights (BN = ROWS_TILE / K rows of W). KESTREL_GEMV=auto
# gives it up to ROWS_AUTO_M rows: at 4 the K loop was faster (session 56, H100: 14.5 us a layer against 15.5).
ROWS_MAX_M = 4
ROWS_AUTO_M = 2
ROWS_MAX_K = 4096
ROWS_TILE = 16384


def rows_most() -> int:
    """The most rows `gemv_many_triton(kernel="auto")` gives the rows kernel: ROWS_AUTO_M with KESTREL_GEMV=auto
    (the default), ROWS_MAX_M with rows, none with dot or off."""
    return {"auto": ROWS_AUTO_M, "rows": ROWS_MAX_M}.get(env_field("gemv"), 0)


def rows_applies(M: int, K: int) -> bool:
    """`gemv_many_triton(kernel="auto")` runs the rows kernel on M rows of width K: up to `rows_most()` rows, K up
    to ROWS_MAX_K."""
    return 0 < M <= rows_most() and triton.next_power_of_2(K) <= ROWS_MAX_K


def rows_tile(M: int, K: int) -> tuple[int, int]:
    """(weight rows a program, warps) of the rows kernel at M rows of width K. One row: ROWS_TILE values (8 rows
    of 2048) on 8 warps, 9.03 us a layer on mini's KDA projections (session 56, H100; 8.93-10.22 over the tiles
    swept). More rows: 2 rows of W on 4 warps, the best timed at 2 rows (11.26 us against the K loop's 14.39);
    ROWS_TILE's tile at 2 rows was not timed, and its sm_90 compile takes 97-103 registers against 48 at one."""
    if M == 1:
        return max(1, min(64, ROWS_TILE // triton.next_power_of_2(K))), 8
    return 2, 4


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, **knobs) -> torch.Tensor:
    """x [..., K] (at most 16 rows), weight [N, K] contiguous -> [..., N] in x.dtype, fp32 sums (`gemv_many_triton`
    of one weight)."""
    return gemv_many_triton(x, [weight], **knobs)[0]


def gemv_many_triton(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    block_n: int | None = None,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    prefetch: bool | None = None,
    kernel: str = "auto",
    rows_block_n: int | None = None,
    rows_warps: int | None = None,
    early: bool = True,
    rows_programs: int | None = None,
    gate: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    conv: tuple | None = None,
) -> list[torch.Tensor]:
    """x [..., K] (at most 16 rows) times each of up to SEGMENTS weights [N_i, K] (contiguous, x's dtype) in one
    launch -> [[..., N_i]] in x.dtype, fp32 sums: each weight's slices are programs of the same grid, so a layer's
    projections of one input cost one launch and their weights stream side by side (MLA's six at batch 1 on the
    H200: 11.0 us against 33.0 as six launches, session 41).

    kernel: "rows" (`_gemv_rows_kernel`: rows_block_n weight rows a slice and rows_warps, None: `rows_tile`'s; early:
    the first slice loaded before the PDL wait; rows_programs: a grid of at most this many programs, each walking
    slices with the next one's loads out before this one's sums, None: a program a slice), "dot" (`_gemv_kernel`:
    block_n None: 64 from 2048 outputs in all up, else 32; block_k, num_warps, num_stages; prefetch, each slice into
    L2 before the PDL wait where PDL is on, None: up to PREFETCH_MAX_BYTES of weights in all), or "auto": rows where
    `rows_applies`, else dot.

    gate (rows kernel only) [..., K] like x: x goes through its output gate first, inside the kernel: with norm
    = (weight [G], eps), `gated_rms_norm` over each group of G columns (KDA's heads); without, `sigmoid_gate`
    (MLA's). The gated x is rounded to x's dtype as those ops leave it; the norm's sum is reduced in another
    order than the norm kernel's, so a value may differ from theirs in its last bit.

    conv (rows kernel, one weight) = (conv_weight [C, W], conv_pool [S, C, W - 1], slots [M], planes [C // P, M, P]):
    the first C output columns also take KDA's short-conv decode step (`triton_conv.conv_step_inplace(out[:, :C],
    conv_weight, conv_pool, slots, planes=C // P)`'s math), its SiLU outputs into planes, each slot's window
    advanced in place."""
    K = x.shape[-1]
    assert 0 < len(weights) <= SEGMENTS, f"{len(weights)} weights: one launch takes 1 to {SEGMENTS}"
    for w in weights:
        assert w.dim() == 2 and w.shape[1] == K and w.is_contiguous(), (
            f"weight {tuple(w.shape)} for width {K}"
        )
        assert w.dtype == weights[0].dtype, "one launch takes weights of one dtype"
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    assert M <= 16, f"{M} rows: the GEMV takes at most 16"
    if kernel == "auto":
        kernel = "rows" if rows_applies(M, K) or gate is not None else "dot"
    assert kernel in ("rows", "dot"), f"kernel {kernel!r}: rows, dot or auto"
    assert gate is None or kernel == "rows", "an output gate goes through the rows kernel only"
    assert conv is None or kernel == "rows" and len(weights) == 1, (
        "the conv step goes with the rows kernel, one weight"
    )
    assert norm is None or gate is not None, "a norm comes with a gate"
    assert kernel == "dot" or M <= ROWS_MAX_M and triton.next_power_of_2(K) <= ROWS_MAX_K, (
        f"the rows kernel takes up to {ROWS_MAX_M} rows of up to {ROWS_MAX_K} columns, not {M} x {K}"
    )
    outs = [torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    segs = [(w, o) for w, o in zip(weights, outs) if w.shape[0]]
    if M and segs:
        pdl = pdl_args(rows)
        total = sum(w.shape[0] for w, _ in segs)
        if kernel == "rows":
            tile_n, tile_warps = rows_tile(M, K)
            block_n, rows_warps = rows_block_n or tile_n, rows_warps or tile_warps
        else:
            block_n = block_n or (64 if total >= 2048 else 32)
        firsts = [0]  # each segment's first program
        for w, _ in segs:
            firsts.append(firsts[-1] + triton.cdiv(w.shape[0], block_n))
        args = []
        for s in range(SEGMENTS):  # the unused segments repeat the first (never selected: SEGS says how many)
            w, o = segs[s] if s < len(segs) else segs[0]
            args += [w, o, w.shape[0]]
        args += [firsts[min(s, len(segs) - 1)] for s in range(1, SEGMENTS)]
        if kernel == "rows":
            kp = triton.next_power_of_2(K)
            gate_args, gate_consts = _gate_args(gate, norm, rows, kp)
            conv_args, conv_consts = _conv_args(conv, rows, weights[0].shape[0])
            blocks = firsts[len(segs)]
            grid = min(blocks, rows_programs) if rows_programs else blocks
            _gemv_rows_kernel[(grid,)](
                rows, K, rows.stride(0), *args, *gate_args, *conv_args, blocks, M=M, BN=block_n, KP=kp,
                SEGS=len(segs), EARLY=early, PERSIST=grid < blocks, num_warps=rows_warps, **gate_consts,
                **conv_consts, **pdl,
            )  # fmt: skip
        else:
            row_bytes = K * weights[0].element_size()
            prefetch = prefetch if prefetch is not None else total * row_bytes <= PREFETCH_MAX_BYTES
            aligned = row_bytes % 16 == 0 and all(w.data_ptr() % 16 == 0 for w, _ in segs)
            dot_f32 = x.dtype == torch.float32 or not x.is_cuda  # the CPU interpreter's tl.dot misreads bf16
            _gemv_kernel[(firsts[len(segs)],)](
                rows, M, K, rows.stride(0), *args,
                BM=16, BN=block_n, BK=min(block_k, max(16, triton.next_power_of_2(K))), DOT_F32=dot_f32,
                PRECISION="ieee" if dot_f32 else "tf32", SEGS=len(segs),
                PREFETCH=row_bytes if prefetch and pdl and aligned else 0,
                num_warps=num_warps, num_stages=num_stages, **pdl,
            )  # fmt: skip
    return [o.view(*x.shape[:-1], o.shape[1]) for o in outs]


def _gate_args(
    gate: torch.Tensor | None, norm: tuple | None, rows: torch.Tensor, kp: int
) -> tuple[tuple, dict]:
    """The rows kernel's gate arguments (gate, its row stride in units of its alignment, norm weight, eps) and
    constants, for x's rows [M, K]; without a gate, placeholders never read."""
    if gate is None:
        return (rows, 0, rows, 0.0), {}
    K = rows.shape[1]
    g = gate.reshape(-1, K)
    g = g if g.stride(-1) == 1 else g.contiguous()
    assert g.shape == rows.shape, f"gate {tuple(gate.shape)} for x {tuple(rows.shape)}"
    align = row_align(g.stride(0))  # the stride passed as units of it: strided rows still load as vectors
    if norm is None:
        return (g, g.stride(0) // align, g, 0.0), dict(GATE=1, G_ALIGN=align)
    norm_w, eps = norm
    G = norm_w.numel()
    assert K % G == 0 and G == triton.next_power_of_2(G) <= kp, (
        f"norm groups of {G} (a power of two dividing K) for K {K}"
    )
    return (g, g.stride(0) // align, norm_w.contiguous(), float(eps)), dict(GATE=2, G=G, G_ALIGN=align)


def _conv_args(conv: tuple | None, rows: torch.Tensor, N: int) -> tuple[tuple, dict]:
    """The rows kernel's conv-step arguments (conv weight, pool, slots, planes, C, plane width, pool strides) and
    constants, for x's rows [M, K] and N outputs; without a conv, placeholders never read."""
    if conv is None:
        return (rows, rows, rows, rows, 0, 1, 0, 0), {}
    conv_w, pool, slots, planes = conv
    (C, W), M = conv_w.shape, rows.shape[0]
    assert conv_w.is_contiguous() and pool.shape[1:] == (C, W - 1) and pool.stride(2) == 1, (
        f"conv weight {tuple(conv_w.shape)}, pool {tuple(pool.shape)}"
    )
    assert C <= N and planes.is_contiguous() and planes.shape[1:2] == (M,), (
        f"{C} conv channels of {N} outputs, planes {tuple(planes.shape)}, {M} rows"
    )
    assert slots.shape == (M,) and C == planes.shape[0] * planes.shape[2]
    args = (conv_w, pool, slots, planes, C, planes.shape[2], pool.stride(0), pool.stride(1))
    return args, dict(CONV=True, W=W, WP=triton.next_power_of_2(W))
