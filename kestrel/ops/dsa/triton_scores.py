"""DSA lightning-indexer scores for decode (one query per sequence) in Triton, dense or through the page table.

Legend: B sequences, HI indexer heads, DI indexer head dim, L = Lmax padded key positions, BS = BLOCK_S key
positions per tile, HP / DP = HI / DI padded to powers of two (at least 16, the smallest tl.dot tile).

    I[b, s] = scale * sum_j w[b, j] * relu(q[b, j] . k[b, s])        for s < lens[b]
    I[b, s] = NaN                                                     for lens[b] <= s < L

The equality with `naive.indexer_scores_batched` holds on the valid positions (same fp32 math, a different
summation order inside the dot, so close rather than bit-equal). Padded positions are NaN, the tie rule's
"invalid" (naive.py): `topk_select(scores, lens - 1, k)` and a top-k that ignores lens pick the same set, and
the keys behind padded positions (another sequence's pages or the dummy page 0) are never read.

Program layout: grid (cdiv(L, BS * tiles_per_prog), B), a program an item of `tiles_per_prog` key tiles of one
row; or, for decode's scores over a wide buffer (fill_past=False, L >= WORK_LIST_MIN_L), one wave of programs
walking the rows' live items in turn (`_indexer_scores_kernel`'s WORK_LIST). An item loads q [HP, DP] and w [HP]
once and walks its key tiles: gather keys [BS, DP] (one 2*DI-byte row per position: paged rows are
page_table[b, s // page_size] * page_size + s % page_size, kestrel.cache.kv_pool), logits = q @ k^T
[HP, BS] on the tensor cores (bf16 in, fp32 accumulate), relu, weight, sum over heads, store BS fp32 scores.
Tiles wholly past lens[b] only store their NaNs (or nothing, on the work list). Bytes per sequence:
lens[b] * (2 * DI + 4), plus (L - lens[b]) * 4 for the padded stores; at HI = 64, DI = 128 the dot is
64 FLOP per key byte, under the H200 ridge (~184), so the kernel is bandwidth-bound on the key reads:
B = 64 rows of 131072 keys are 2.2 GB, ~0.51 ms at the 4.25 TB/s copy ceiling; one row of 4096 keys is
1 MB, launch-bound. The key gathers are pipelined with cp.async across the tile loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.occupancy import programs_an_sm
from kestrel.ops.pdl import pdl_args, pdl_begin

# Key positions a tile, the tile loop's pipeline depth, and the most tiles a program walks. On the H200 (session
# 24, mini's 16 heads of 128, bf16 keys, page 64, 4K context, 6 layers' calls in a CUDA graph; the sweep's source
# and figures in bench/results/2026-12-01-h200-session24.json), us a call at batch 1 / 64 / 256: 128 positions,
# 2 stages, at most 4 tiles a program 3.5 / 21.9 / 70.4 against 3.5 / 27.7 / 82.0 for 64 positions, Triton's
# default 3 stages and up to 8 tiles (the keys' floor at the copy rate: 0.2 / 16.0 / 63.8); 8 warps were slower.
BLOCK_S, NUM_STAGES, MAX_TILES_PER_PROG = 128, 2, 4
# The prefill kernel's tiles (query rows x key positions), warps and pipeline stages. scripts/prefill_kernel_sweep.py
# on the H200 (session 13), 16 heads of 128, one causal sequence: 64 x 128 in 4 warps, 3 stages took 0.171 / 5.05 ms
# at 4096 / 32768 tokens against 0.185 / 5.45 for the 64 x 64 before it (the query rows are read once per key
# tile: a wider tile reads them half as often); 128-row tiles were slower.
PREFILL_BLOCK_M, PREFILL_BLOCK_S, PREFILL_WARPS, PREFILL_STAGES = 64, 128, 4, 3
TARGET_PROGRAMS = 1024  # enough programs to fill 132 SMs several times over before tiles are merged
# Without the NaNs past each row's length (decode's scores, fill_past=False) over a buffer at least
# WORK_LIST_MIN_L wide, the kernel walks a work list: one wave of programs shares out the live items of every row,
# so that a short row in a wide buffer (decode's graphs are as wide as the engine's longest context) costs its own
# tiles only, not a program per item of the width. Up to WORK_LIST_MAX_ROWS rows (the list's bookkeeping is a [B]
# vector in each program); under the interpreter WORK_LIST_CPU_PROGRAMS programs, so that each walks several
# items. On the H200 (session 47, scripts in bench/results/2026-12-04-h200-session47.json; 16 heads of 128, six
# calls in a CUDA graph), us a call, grid of the width's items / work list: rows of 4096 in a 131072-wide buffer,
# 1 / 64 / 256 rows 5.0 / 75.9 / 274.7 against 3.5 / 22.8 / 74.5 (the session's starting kernel, which also
# scored the dead tiles: 7.4 / 381.6 / 1517.5); in a 4096-wide one equal (2.9-3.0 / 22.9-24.0 / 73.3-74.2); full
# rows of 131072, 1 / 64, 10.2 / 508.5 against 12.0 / 539.1 (the list's one wave walks each item's tiles after
# the last; the grid overlaps them). Below WORK_LIST_MIN_L the grid's dead items are few, and decode's step at
# 4K context, 4K-wide, was 0.6% slower through the list at 256 rows (6.39-6.41 against 6.36-6.37 ms).
WORK_LIST_MIN_L, WORK_LIST_MAX_ROWS, WORK_LIST_CPU_PROGRAMS = 16384, 1024, 3
_held: dict = {}  # (device, dtypes, constants) -> the programs the GPU holds at once


@triton.jit
def _score_tiles(
    q_ptr,
    w_ptr,
    k_ptr,
    page_table_ptr,
    key_scale_ptr,
    out_ptr,
    b,  # the row (int64)
    n,  # its valid positions (int32)
    first,  # the item's first key tile
    tiles_per_prog,  # the item's tiles
    scale,
    w_scale,
    L,
    page_size,
    stride_qb,
    stride_qh,
    stride_wb,
    stride_kb,
    stride_kr,
    stride_ptb,
    stride_ob,
    HI: tl.constexpr,
    DI: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    PAGED: tl.constexpr,
    UPCAST: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Row b's scores on the item's tiles from `first` that hold a position below n (`live` of them, returned):
    q [HP, DP] and w [HP] loaded once, then a tile at a time the keys gathered, q @ k^T, relu, weighted, summed
    over heads; NaN past n in the last tile. The tiles after them cost nothing."""
    live = tl.minimum(tl.maximum(n - first * BS + BS - 1, 0) // BS, tiles_per_prog)
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    q = tl.load(
        q_ptr + b * stride_qb + h[:, None] * stride_qh + d[None, :],
        mask=(h[:, None] < HI) & (d[None, :] < DI),
        other=0.0,
    )  # [HP, DP]
    w = tl.load(w_ptr + b * stride_wb + h, mask=h < HI, other=0.0).to(tl.float32) * w_scale  # [HP]
    if UPCAST:
        q = q.to(tl.float32)
    for t in range(live):
        s = (first + t) * BS + tl.arange(0, BS)  # [BS]
        valid = s < n
        if PAGED:
            page = tl.load(page_table_ptr + b * stride_ptb + s // page_size, mask=valid, other=0)
            rows = page.to(tl.int64) * page_size + s % page_size  # [BS]
            k_rows = k_ptr + rows * stride_kr
        else:
            k_rows = k_ptr + b * stride_kb + s.to(tl.int64) * stride_kr
        k = tl.load(
            k_rows[:, None] + d[None, :], mask=valid[:, None] & (d[None, :] < DI), other=0.0
        )  # [BS, DP]
        if UPCAST:
            k = k.to(tl.float32)
        elif KEY_SCALE:
            k = k.to(q.dtype)  # FP8 -> the query's 16-bit type: exact
        logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [HP, BS] fp32
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0) * scale  # [BS]
        if KEY_SCALE:  # relu(q . (s k)) = s relu(q . k) for s > 0: the key's scale applies after the sum
            score = score * tl.load(key_scale_ptr + rows, mask=valid, other=1.0)
        score = tl.where(valid, score, float("nan"))
        tl.store(out_ptr + b * stride_ob + s, score, mask=s < L)
    return live


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # [B, HI, DI]
    w_ptr,  # [B, HI]
    k_ptr,  # paged: [rows, DI]; dense: [B, L, DI]
    page_table_ptr,  # paged: [B, maxp]
    lens_ptr,  # [B] int64
    key_scale_ptr,  # paged FP8 keys: [rows] fp32 per-token scales (else unused)
    out_ptr,  # [B, L] fp32
    scale,
    w_scale,  # the weights' own factor, applied in fp32 (1.0 for weights handed over scaled)
    B,
    L,
    page_size,
    tiles_per_prog,
    stride_qb,
    stride_qh,
    stride_wb,
    stride_kb,
    stride_kr,
    stride_ptb,
    stride_ob,
    HI: tl.constexpr,
    DI: tl.constexpr,
    HP: tl.constexpr,
    DP: tl.constexpr,
    BS: tl.constexpr,
    PAGED: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dot in fp32
    KEY_SCALE: tl.constexpr,  # FP8 keys with one scale per token (paged only)
    DOT_PRECISION: tl.constexpr,
    WORK_LIST: tl.constexpr,  # grid (programs,) over the rows' live items; else grid (chunks, B), NaN past n
    BP: tl.constexpr,  # WORK_LIST: B padded to a power of two
    PDL: tl.constexpr = False,
):
    """An item is tiles_per_prog key tiles of one row. WORK_LIST: the items holding a position below their row's
    length, numbered row after row, shared out among the programs in turn (pid, pid + programs, ...); the tiles
    past each row's length are neither scored nor written. Else one program an item of the [B, L] buffer: the
    tiles past the row's length only store NaN."""
    pdl_begin(PDL)
    chunk = tiles_per_prog * BS
    if WORK_LIST:
        r = tl.arange(0, BP)
        # positions in int32 (L < 2^31): the page index's division and modulo in int64 cost the kernel ~1.5x
        n_rows = tl.minimum(tl.maximum(tl.load(lens_ptr + r, mask=r < B, other=0), 0), L).to(tl.int32)  # [BP]
        items = (n_rows + chunk - 1) // chunk  # [BP] each row's live items
        ends = tl.cumsum(items, 0)  # [BP] one past each row's last item
        for item in range(tl.program_id(0), tl.sum(items, 0), tl.num_programs(0)):
            row = tl.sum((ends <= item).to(tl.int32), 0)  # the first row whose items end past it
            here = r == row
            n = tl.sum(tl.where(here, n_rows, 0), 0)
            first = (item - tl.sum(tl.where(here, ends - items, 0), 0)) * tiles_per_prog
            _score_tiles(
                q_ptr, w_ptr, k_ptr, page_table_ptr, key_scale_ptr, out_ptr, row.to(tl.int64), n, first,
                tiles_per_prog, scale, w_scale, L, page_size, stride_qb, stride_qh, stride_wb, stride_kb, stride_kr,
                stride_ptb, stride_ob, HI, DI, HP, DP, BS, PAGED, UPCAST, KEY_SCALE, DOT_PRECISION,
            )  # fmt: skip
    else:
        b = tl.program_id(1).to(tl.int64)
        n = tl.minimum(tl.maximum(tl.load(lens_ptr + b), 0), L).to(tl.int32)  # int32, as above
        first = tl.program_id(0) * tiles_per_prog
        live = _score_tiles(
            q_ptr, w_ptr, k_ptr, page_table_ptr, key_scale_ptr, out_ptr, b, n, first, tiles_per_prog,
            scale, w_scale, L, page_size, stride_qb, stride_qh, stride_wb, stride_kb, stride_kr,
            stride_ptb, stride_ob, HI, DI, HP, DP, BS, PAGED, UPCAST, KEY_SCALE, DOT_PRECISION,
        )  # fmt: skip
        for t in range(live, tiles_per_prog):
            s = (first + t) * BS + tl.arange(0, BS)
            tl.store(out_ptr + b * stride_ob + s, float("nan"), mask=s < L)


def _launch(
    q_idx,
    weights,
    keys,
    page_table,
    lens,
    scale,
    L,
    page_size,
    paged,
    stride_kb,
    stride_kr,
    out,
    key_scale=None,
    w_scale=1.0,
    fill_past=True,
):
    B, HI, DI = q_idx.shape
    assert weights.shape == (B, HI), f"weights {tuple(weights.shape)} != {(B, HI)}"
    assert lens.shape == (B,), f"lens {tuple(lens.shape)} != {(B,)}"
    assert q_idx.stride(-1) == 1 and weights.stride(-1) == 1 and keys.stride(-1) == 1
    if out is None:
        out = torch.empty(B, L, dtype=torch.float32, device=q_idx.device)  # [B, L]
    assert out.shape == (B, L) and out.dtype == torch.float32 and out.stride(-1) == 1
    if B == 0 or L == 0:
        return out
    lens = lens.to(torch.int64)
    tiles = triton.cdiv(L, BLOCK_S)
    tiles_per_prog = max(1, min(MAX_TILES_PER_PROG, tiles * B // TARGET_PROGRAMS))
    chunks = triton.cdiv(tiles, tiles_per_prog)
    work_list = not fill_past and L >= WORK_LIST_MIN_L and B <= WORK_LIST_MAX_ROWS
    fp8 = key_scale is not None
    upcast = _upcast(q_idx, keys, fp8)
    args = (
        q_idx, weights, keys, page_table, lens,
        key_scale if fp8 else lens,  # a placeholder pointer without FP8 keys
        out, float(scale), float(w_scale), B, L, page_size, tiles_per_prog,
        q_idx.stride(0), q_idx.stride(1), weights.stride(0), stride_kb, stride_kr, page_table.stride(0),
        out.stride(0),
    )  # fmt: skip
    consts = dict(
        HI=HI,
        DI=DI,
        HP=max(16, triton.next_power_of_2(HI)),
        DP=max(16, triton.next_power_of_2(DI)),
        BS=BLOCK_S,
        PAGED=paged,
        UPCAST=upcast,
        KEY_SCALE=fp8,
        DOT_PRECISION="ieee" if upcast else "tf32",
        WORK_LIST=work_list,
        BP=triton.next_power_of_2(B) if work_list else 1,
        num_warps=4,
        num_stages=NUM_STAGES,
        **pdl_args(out),
    )
    grid = (min(chunks * B, _resident(args, consts, q_idx.device)),) if work_list else (chunks, B)
    _indexer_scores_kernel[grid](*args, **consts)
    return out


def _resident(args, consts: dict, device: torch.device) -> int:
    """The work list's programs: as many as the GPU holds at once (one wave, read from the compiled kernel),
    WORK_LIST_CPU_PROGRAMS under the interpreter."""
    if device.type != "cuda":
        return WORK_LIST_CPU_PROGRAMS
    key = (device, *(t.dtype for t in args[:3]), *consts.items())
    if key not in _held:
        compiled = _indexer_scores_kernel.warmup(*args, grid=(1,), **consts)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        _held[key] = sms * max(1, programs_an_sm(compiled, consts["num_warps"], device))
    return _held[key]


def _upcast(q_idx: torch.Tensor, keys: torch.Tensor, fp8: bool) -> bool:
    """Whether the kernels compute the dot in fp32 (then "ieee" precision): the CPU interpreter's tl.dot reads
    bf16 as raw bits, fp32 queries stay fp32, and mixed 16-bit dtypes need one type (FP8 keys are cast to the
    query's type in the kernel instead)."""
    return (
        q_idx.device.type == "cpu" or q_idx.dtype == torch.float32 or (q_idx.dtype != keys.dtype and not fp8)
    )


def indexer_scores_triton(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode indexer scores over padded per-sequence keys.

    q_idx [B, HI, DI], k_idx [B, L, DI], weights [B, HI] (bf16 or fp32), lens [B] (default: all L).
    Returns [B, L] fp32 (written into `out` when given): `naive.indexer_scores_batched` on s < lens[b],
    NaN beyond.
    """
    B, L, DI = k_idx.shape
    assert q_idx.shape[0] == B and q_idx.shape[2] == DI, (
        f"q_idx {tuple(q_idx.shape)} vs k_idx {tuple(k_idx.shape)}"
    )
    if lens is None:
        lens = torch.full((B,), L, dtype=torch.int64, device=k_idx.device)
    if k_idx.stride(-1) != 1:
        k_idx = k_idx.contiguous()
    return _launch(
        q_idx, weights, k_idx, lens, lens, scale, L, 1, False, k_idx.stride(0), k_idx.stride(1), out
    )


def indexer_scores_paged_triton(
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    *,
    page_size: int,
    key_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    weights_scale: float = 1.0,
    fill_past: bool = True,
) -> torch.Tensor:
    """Decode indexer scores reading the keys through the page table (the layout of kestrel.cache.kv_pool).

    q_idx [B, HI, DI], k_pool [rows, DI] (one layer's `KVPool.index_k`; FP8 E4M3 with `key_scale` [rows, 1]
    or [rows] fp32, one scale per token, when the pool keeps FP8 keys), page_table [B, maxp] (int32 or
    int64; position p of sequence b is row page_table[b, p // page_size] * page_size + p % page_size),
    lens [B], weights [B, HI]: fp32 and scaled, or as projected (bf16, say) with weights_scale, which the kernel
    applies to them in fp32 (the same products as `weights.float() * weights_scale`, two launches fewer: mini's
    replayed step at 4K on the H200, session 44, batch 1 1.415 against 1.429-1.434 ms, 256 6.309 against
    6.350-6.353). Returns
    [B, maxp * page_size] fp32 (written into `out` when given), the width `read_kv_batched` gives: the scores on
    s < lens[b], NaN beyond. With fill_past=False (for a top-k that reads each row's first lens[b] only, as
    decode's does) over at least WORK_LIST_MIN_L positions and up to WORK_LIST_MAX_ROWS rows, one wave of programs
    walks the rows' live tiles and leaves the tiles wholly past lens[b] unwritten: decode's graphs are as wide as
    the engine's longest context, and a short row then costs its own tiles only, not a program for each of the
    width's (elsewhere those tiles are NaN, as with fill_past=True).
    """
    B, maxp = page_table.shape
    assert k_pool.dim() == 2 and k_pool.shape[1] == q_idx.shape[2], f"k_pool {tuple(k_pool.shape)}"
    assert q_idx.shape[0] == B, f"q_idx {tuple(q_idx.shape)} vs page_table {tuple(page_table.shape)}"
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    L = maxp * page_size
    if key_scale is not None:
        assert key_scale.shape[0] == k_pool.shape[0] and key_scale.numel() == k_pool.shape[0], (
            "one scale per row"
        )
        key_scale = key_scale.reshape(-1).float()
    return _launch(
        q_idx,
        weights,
        k_pool,
        page_table,
        lens,
        scale,
        L,
        page_size,
        True,
        0,
        k_pool.stride(0),
        out,
        key_scale,
        weights_scale,
        fill_past,
    )


@triton.jit
def _indexer_prefill_kernel(
    q_ptr,  # [T, HI, DI]
    w_ptr,  # [T, HI]
    k_ptr,  # [rows, DI] the layer's paged index keys
    pages_ptr,  # [P] the sequence's pages
    lens_ptr,  # [T] each query row's causal length
    starts_ptr,  # [T] each query row's first visible position (HAS_STARTS; else unused)
    key_scale_ptr,  # FP8 keys: [rows] fp32 per-token scales (else unused)
    out_ptr,  # [T, L] fp32
    scale,
    T,
    L,
    page_size,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kr,
    stride_ot,
    HI: tl.constexpr,
    DI: tl.constexpr,
    DP: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    UPCAST: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FILL_PAST: tl.constexpr,
    HAS_STARTS: tl.constexpr,
):
    """Scores of BM query rows of one sequence against BS of its key positions: the key tile is gathered once
    and multiplied against every row's heads in turn ([BM, DP] x [DP, BS] on the tensor cores). A tile no row
    sees (past every row's length, or before every row's start) is not computed: its NaNs are stored, except
    past every row's length without FILL_PAST."""
    lo = tl.program_id(0) * BS
    s = lo + tl.arange(0, BS)  # [BS] key positions
    r = tl.program_id(1) * BM + tl.arange(0, BM)  # [BM] query rows
    rmask = r < T
    n = tl.minimum(tl.load(lens_ptr + r, mask=rmask, other=0), L)  # [BM] visible positions of each row
    if HAS_STARTS:
        n0 = tl.load(starts_ptr + r, mask=rmask, other=L)  # [BM] the first of them
    else:
        n0 = tl.zeros([BM], dtype=tl.int64)
    d = tl.arange(0, DP)
    acc = tl.zeros([BM, BS], dtype=tl.float32)
    n_max = tl.max(n, axis=0)  # the block's furthest row
    past = lo >= n_max
    live = (lo + BS > tl.min(n0, axis=0)) & (lo < n_max)
    if live:  # a key of this tile is visible to one of the rows
        kvalid = s < n_max
        page = tl.load(pages_ptr + s // page_size, mask=kvalid, other=0)
        rows = page.to(tl.int64) * page_size + s % page_size  # [BS]
        k = tl.load(
            k_ptr + rows[:, None] * stride_kr + d[None, :],
            mask=kvalid[:, None] & (d[None, :] < DI),
            other=0.0,
        )  # [BS, DP]
        if UPCAST:
            k = k.to(tl.float32)
        elif KEY_SCALE:
            k = k.to(q_ptr.dtype.element_ty)  # FP8 -> the query's 16-bit type: exact
        for h in range(HI):
            q = tl.load(
                q_ptr + r[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & (d[None, :] < DI),
                other=0.0,
            )  # [BM, DP]
            if UPCAST:
                q = q.to(tl.float32)
            w = tl.load(w_ptr + r.to(tl.int64) * stride_wt + h, mask=rmask, other=0.0).to(tl.float32)  # [BM]
            logits = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BS] fp32
            acc += tl.maximum(logits, 0.0) * w[:, None]
        acc = acc * scale
        if KEY_SCALE:  # relu(q . (c k)) = c relu(q . k) for c > 0: the key's scale applies after the sum
            acc = acc * tl.load(key_scale_ptr + rows, mask=kvalid, other=1.0)[None, :]
    out = tl.where((s[None, :] < n[:, None]) & (s[None, :] >= n0[:, None]), acc, float("nan"))
    store = rmask[:, None] & (s[None, :] < L)
    if not FILL_PAST:
        store = tl.where(past, False, store)
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_ot + s[None, :], out, mask=store)


def indexer_scores_prefill_triton(
    q_idx: torch.Tensor,
    k_pool: torch.Tensor,
    pages: torch.Tensor,
    lens: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    *,
    page_size: int,
    key_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int = PREFILL_BLOCK_M,
    block_s: int | None = None,
    num_warps: int = PREFILL_WARPS,
    num_stages: int = PREFILL_STAGES,
    fill_past: bool = True,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill indexer scores of one sequence's T query rows over its paged keys, each row with its causal
    length: q_idx [T, HI, DI], k_pool [rows, DI] (FP8 with `key_scale` as in `indexer_scores_paged_triton`),
    pages [P] (the sequence's page-table row), lens [T], weights [T, HI]. Returns [T, P * page_size] fp32: the
    scores of `indexer_scores_paged_triton` with every row reading `pages`, NaN past each row's length. With
    fill_past=False the tiles past every row of their block's length are left unwritten (whatever `out` held):
    for a consumer that reads each row's first lens[t] only, as `topk_triton` does (it saves a prefill of T
    rows about T^2 / 2 x 4 bytes of writes). block_s None: PREFILL_BLOCK_S for 16-bit dots, 64 where the dot
    runs in fp32 (twice the bytes a tile: at mini's 128-wide heads, 64 x 128 fp32 tiles in 3 stages would need
    ~288 KiB of shared memory, past the H200's 227 KiB). `starts` [T] (training's packed rows: each query's
    document begins there) makes the positions before starts[t] NaN too, and a key tile before every row's
    start of its block is not computed.

    The decode kernel run with every prefill token as a row reads the sequence's keys once per token (T x L x
    2 DI bytes: ~45 ms of an 8 x 4096-token prefill step of `mini` on the H200); here a key tile is read once
    per block of `block_m` rows, and the work is [BM, DI] x [DI, BS] products on the tensor cores."""
    T, HI, DI = q_idx.shape
    assert weights.shape == (T, HI) and lens.shape == (T,), (
        f"weights {tuple(weights.shape)}, lens {tuple(lens.shape)}"
    )
    assert starts is None or starts.shape == (T,), f"starts {tuple(starts.shape)}"
    assert pages.dim() == 1 and k_pool.dim() == 2 and k_pool.shape[1] == DI, f"pages {tuple(pages.shape)}"
    assert q_idx.stride(-1) == 1 and weights.stride(-1) == 1 and k_pool.stride(-1) == 1
    L = pages.shape[0] * page_size
    if out is None:
        out = torch.empty(T, L, dtype=torch.float32, device=q_idx.device)
    assert out.shape == (T, L) and out.dtype == torch.float32 and out.stride(-1) == 1
    if T == 0 or L == 0:
        return out
    fp8 = key_scale is not None
    if fp8:
        assert key_scale.numel() == k_pool.shape[0], "one scale per row"
        key_scale = key_scale.reshape(-1).float()
    upcast = _upcast(q_idx, k_pool, fp8)
    if block_s is None:
        block_s = 64 if upcast else PREFILL_BLOCK_S
    grid = (triton.cdiv(L, block_s), triton.cdiv(T, block_m))
    _indexer_prefill_kernel[grid](
        q_idx,
        weights,
        k_pool,
        pages.contiguous(),
        lens.to(torch.int64),
        lens if starts is None else starts.to(torch.int64),  # a placeholder pointer without starts
        key_scale if fp8 else lens,  # a placeholder pointer without FP8 keys
        out,
        float(scale),
        T,
        L,
        page_size,
        q_idx.stride(0),
        q_idx.stride(1),
        weights.stride(0),
        k_pool.stride(0),
        out.stride(0),
        HI=HI,
        DI=DI,
        DP=max(16, triton.next_power_of_2(DI)),
        BM=block_m,
        BS=block_s,
        UPCAST=upcast,
        KEY_SCALE=fp8,
        DOT_PRECISION="ieee" if upcast else "tf32",
        FILL_PAST=fill_past,
        HAS_STARTS=starts is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
