"""Exact row-wise top-k for DSA in Triton: `topk_triton(scores, lens, k)` selects the same positions as
`naive.topk_select(scores, lens - 1, k)`, listed in position order instead of rank order (every consumer, the
sparse attention and the training mask, uses the set; position order also reads the KV pages in order).

Legend: B rows, L scores per row, n = min(lens[b], L) the row's positions, k = index_topk, S = cdiv(L, SEG)
segments per row, m the sampled scores of a row, C its candidates (positions that pass the sampled threshold).

The order. Each score maps to a 32-bit key whose unsigned order is the float order (-0.0 is first made +0.0,
so the two tie as IEEE equality says); a NaN or a position >= n gets key 0, below every valid key (a valid
-inf is 0x007FFFFF). (key desc, position asc) is then a strict total order, the tie rule of naive.py, and the
selection is its first min(k, valid) elements, listed by position, then -1.

Two kernels, no host syncs (CUDA-graph safe), and one full read of the row:

1. `_filter_kernel`, grid (S, B). Every program of a row first draws the same sample of m = SAMPLE scores
   (the whole row when n <= SAMPLE; else SAMPLE / 8 runs of 8 consecutive scores spread evenly over the row:
   whole 32-byte sectors) and takes from it a threshold `lo`: the 16-bit key prefix of the sample's r_lo-th
   largest key, with r = ceil(k m / n) the rank the k-th largest key of the row would have in the sample and
   r_lo = r + ceil(4 sqrt(r)) + margin (about 4.5 standard deviations above it for scores in random order).
   Then it copies the (key, position) of each key >= lo of its SEG scores, in position order, to its own
   region of the row's candidate list (SEG slots from seg x SEG), and stores its count. At least r_lo of the
   row's keys are >= lo (the sample is part of the row), so when r_lo >= k the row's k largest are always
   among the candidates; otherwise the sample may overshoot (step 2 then reads the row itself).
2. `_select_kernel`, grid (B,): if the candidates hold fewer than k keys while `lo` excluded some (a sample
   that overshot), the row itself becomes the candidate list. Over the candidates, four 256-bin histograms
   (8 key bits each) give the exact k-th largest key T and how many keys equal to T are needed; it writes
   every candidate above T and the first `need` ties at T (the candidates are in position order, so these are
   the lowest positions: the tie rule), in that position order; no sort.

Why a sampled threshold instead of radix passes over the row (until 2026-11-30, session 14): three full reads
with a histogram each (top 6 key bits, next 5, then the compaction) ran at ~1 TB/s, 31 + 33 + 32 us of the
~113 us at 64 x 131072 (torch.topk: 169-193 us), because `tl.histogram` costs about (bins / 32) x log2(bins)
operations per element. The sample needs no row-wide histogram before the compaction, so the row is read once.

Memory traffic per row of L = 131072 (512 KiB of scores), k = 2048: step 1 reads the row once and each of its
S programs reads the 16 KiB sample (L2); it writes 8 B per candidate (C is about k x r_lo / r, 3-4 K
positions for random scores: ~30 KiB); step 2 reads the candidates five times (L1/L2) and writes 16 KiB of
indices. For 64 rows ~38 MB: ~9 us at the 4.25 TB/s copy ceiling, plus two launches.

Scratch: 8 B per score for the candidate list (its worst case, all scores equal, keeps the whole row),
4 B per segment and 4 B per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SEG = 16384  # scores per program in step 1
BLOCK = 4096  # scores per loop iteration in step 1
CBLOCK = 4096  # candidates per loop iteration in step 2
SAMPLE = 4096  # scores each row's threshold is drawn from (runs of RUN consecutive ones)
RUN = 8  # a run of the sample: one 32-byte sector of fp32 scores
MARGIN = 16  # ranks added to r + 4 sqrt(r) (tests set 0 so that small samples overshoot)
MAX_ROWS = 32768  # rows per launch: the grid's second dimension stops at 65535 (and bounds the scratch)
NUM_WARPS = 8
SAMPLE_BITS = 5  # the sample's threshold: three 32-bin digits, the top 15 key bits


@triton.jit
def _sort_key(x, valid):
    """fp32 scores -> uint32 keys ordered as the floats; invalid (masked or NaN) -> 0."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0: one key for both
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    return tl.where(valid & (x == x), key, 0)


@triton.jit
def _threshold_bin(hist, need, NB: tl.constexpr):
    """The bin of the need-th largest key: the largest i with count(bins >= i) >= need (0 when no bin
    qualifies), and the count of keys in bins above it."""
    i = tl.arange(0, NB)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [NB]
    bin_ = tl.max(tl.where(at_or_above >= need, i, 0), 0)
    above = tl.sum(tl.where(i > bin_, hist, 0), 0)
    return bin_, above


@triton.jit
def _threshold_kernel(
    scores_ptr,  # [B, L] fp32
    lens_ptr,  # [B] int64
    lo_ptr,  # [B] int32 (uint32 keys)
    L,
    k,
    stride_sb,
    SAMPLE: tl.constexpr,
    RUN: tl.constexpr,
    MARGIN: tl.constexpr,
    NB: tl.constexpr,
    BITS: tl.constexpr,
):
    """Step 1's `lo` of row b (see the module docstring), from its sample held in registers; 0 (every valid
    key) when the sample holds fewer than r_lo valid keys."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + b), L).to(tl.int32)
    i = tl.arange(0, SAMPLE)
    whole = n <= SAMPLE
    step = n // (SAMPLE // RUN)
    spread = (i // RUN) * step // RUN * RUN + i % RUN  # runs start on 8-score boundaries; < n, no overflow
    p = tl.where(whole, i, spread)  # [SAMPLE]
    key = _sort_key(tl.load(scores_ptr + b * stride_sb + p, mask=p < n, other=float("nan")), p < n)
    m = tl.minimum(n, SAMPLE).to(tl.float32)
    r = tl.ceil(k * m / tl.maximum(n, 1).to(tl.float32))
    need = tl.where(whole, k, r + tl.ceil(4.0 * tl.sqrt(r)) + MARGIN).to(tl.int32)
    # the need-th largest valid key's top 3 x BITS bits, BITS at a time (small histograms are cheap)
    d, above = _threshold_bin(tl.histogram((key >> (32 - BITS)).to(tl.int32), NB, mask=key != 0), need, NB)
    prefix = d
    need -= above
    inside = (key != 0) & ((key >> (32 - BITS)).to(tl.int32) == prefix)
    d, above = _threshold_bin(
        tl.histogram(((key >> (32 - 2 * BITS)) & (NB - 1)).to(tl.int32), NB, mask=inside), need, NB
    )
    prefix = prefix * NB + d
    need -= above
    inside = (key != 0) & ((key >> (32 - 2 * BITS)).to(tl.int32) == prefix)
    d, _ = _threshold_bin(
        tl.histogram(((key >> (32 - 3 * BITS)) & (NB - 1)).to(tl.int32), NB, mask=inside), need, NB
    )
    prefix = prefix * NB + d
    tl.store(lo_ptr + b, (prefix.to(tl.uint32) << (32 - 3 * BITS)).to(tl.int32, bitcast=True))


@triton.jit
def _filter_kernel(
    scores_ptr,  # [B, L] fp32
    lens_ptr,  # [B] int64
    count_ptr,  # [B, S] int32: candidates of each segment
    lo_ptr,  # [B] int32 (uint32 keys): each row's threshold
    cand_key_ptr,  # [B, LC] int32 (uint32 keys)
    cand_pos_ptr,  # [B, LC] int32
    L,
    LC,
    num_segs,
    k,
    stride_sb,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seg = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + b), L)
    row = scores_ptr + b * stride_sb
    lo = tl.load(lo_ptr + b).to(tl.uint32, bitcast=True)
    start = seg * SEG
    end = tl.minimum(start + SEG, n)  # only the valid prefix is read
    keys = cand_key_ptr + b * LC + start  # this segment's region of the row's list
    poss = cand_pos_ptr + b * LC + start
    count = tl.zeros([], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        p = off + tl.arange(0, BLOCK)  # [BLOCK]
        # Masking the load by the row width rather than by lens keeps it vectorized when L % 16 == 0.
        x = tl.load(row + p, mask=p < L, other=float("nan"))
        key = _sort_key(x, p < end)
        take = (key != 0) & (key >= lo)
        take_i = take.to(tl.int32)
        slot = count + tl.cumsum(take_i, 0) - 1  # position order within the segment
        tl.store(keys + slot, key.to(tl.int32, bitcast=True), mask=take)
        tl.store(poss + slot, p, mask=take)
        count += tl.sum(take_i, 0)
    tl.store(count_ptr + b * num_segs + seg, count)


@triton.jit
def _load_candidates(i, n_list, n_row, row_ptr, key_ptr, pos_ptr):
    """Candidates i [CBLOCK] of a row: (key, position), key 0 past the candidates. Either the first n_list of
    the (gathered) list or the first n_row scores of the row itself, where it is position i (one of n_list
    and n_row is 0). List loads masked at a multiple of 16 stay vectorized (the rows are padded to LC)."""
    n_load = (n_list + 15) // 16 * 16
    key = tl.load(key_ptr + i, mask=i < n_load, other=0).to(tl.uint32, bitcast=True)
    pos = tl.load(pos_ptr + i, mask=i < n_load, other=0)
    key = tl.where(i < n_list, key, 0)
    on_row = i < n_row
    x = tl.load(row_ptr + i, mask=on_row, other=float("nan"))
    key = tl.where(on_row, _sort_key(x, on_row), key)
    pos = tl.where(on_row, i, pos)
    return key, pos


@triton.jit
def _refine(
    n_list,
    n_row,
    row_ptr,
    key_ptr,
    pos_ptr,
    prefix,
    need,
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    CBLOCK: tl.constexpr,
):
    """One radix digit of T: among the valid candidates whose key bits above SHIFT + BITS equal `prefix`, the
    digit (key bits SHIFT + BITS - 1 .. SHIFT) holding the need-th largest key. Returns (that digit, need less
    the keys in higher digits, the valid keys counted)."""
    h = tl.zeros([2**BITS], dtype=tl.int32)
    for off in range(0, tl.maximum(n_list, n_row), CBLOCK):
        i = off + tl.arange(0, CBLOCK)
        key, _ = _load_candidates(i, n_list, n_row, row_ptr, key_ptr, pos_ptr)
        inside = key != 0
        if SHIFT + BITS < 32:
            inside = inside & ((key >> (SHIFT + BITS)).to(tl.int32) == prefix)
        h += tl.histogram(((key >> SHIFT) & (2**BITS - 1)).to(tl.int32), 2**BITS, mask=inside)
    digit, above = _threshold_bin(h, need, 2**BITS)
    return digit, need - above, tl.sum(h, 0)


@triton.jit
def _select_kernel(
    scores_ptr,  # [B, L] fp32
    lens_ptr,  # [B] int64
    count_ptr,  # [B, S] int32
    lo_ptr,  # [B] int32
    cand_key_ptr,  # [B, LC] int32
    cand_pos_ptr,  # [B, LC] int32
    out_ptr,  # [B, k] int64
    L,
    LC,
    num_segs,
    k,
    stride_sb,
    stride_ob,
    SEG: tl.constexpr,
    CBLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + b), L)
    row = scores_ptr + b * stride_sb
    keys, poss = cand_key_ptr + b * LC, cand_pos_ptr + b * LC

    # Gather the segments' candidates into one list [0, total), in place and in order: segment s's go from
    # s x SEG down to the count before it, which never overwrites what is still to be read (each segment
    # holds at most SEG); a barrier between each tile's loads and its stores.
    total = tl.zeros([], dtype=tl.int32)
    for seg in range(0, num_segs):
        count = tl.load(count_ptr + b * num_segs + seg)
        for off in range(0, count, CBLOCK):
            j = off + tl.arange(0, CBLOCK)
            key = tl.load(keys + seg * SEG + j, mask=j < count)
            pos = tl.load(poss + seg * SEG + j, mask=j < count)
            tl.debug_barrier()
            tl.store(keys + total + j, key, mask=j < count)
            tl.store(poss + total + j, pos, mask=j < count)
        total += count
    tl.debug_barrier()

    lo = tl.load(lo_ptr + b).to(tl.uint32, bitcast=True)
    from_row = (total < k) & (lo != 0)  # the sample overshot: read the row itself
    n_list = tl.where(from_row, 0, total)
    n_row = tl.where(from_row, n, 0)

    # T, 5 bits at a time (32-bin histograms cost about as much as 8-bin ones and 1/8 of 256-bin ones per bit);
    # the first pass also counts the valid candidates (all of them, on the list)
    d, need, valid = _refine(n_list, n_row, row, keys, poss, 0, k, 27, 5, CBLOCK)
    refine = valid > k  # else every valid candidate is taken and the other passes are skipped
    n_list_r, n_row_r = tl.where(refine, n_list, 0), tl.where(refine, n_row, 0)
    t = d
    d, need, _ = _refine(n_list_r, n_row_r, row, keys, poss, t, need, 22, 5, CBLOCK)
    t = t * 32 + d
    d, need, _ = _refine(n_list_r, n_row_r, row, keys, poss, t, need, 17, 5, CBLOCK)
    t = t * 32 + d
    d, need, _ = _refine(n_list_r, n_row_r, row, keys, poss, t, need, 12, 5, CBLOCK)
    t = t * 32 + d
    d, need, _ = _refine(n_list_r, n_row_r, row, keys, poss, t, need, 7, 5, CBLOCK)
    t = t * 32 + d
    d, need, _ = _refine(n_list_r, n_row_r, row, keys, poss, t, need, 2, 5, CBLOCK)
    t = t * 32 + d
    d, need, _ = _refine(n_list_r, n_row_r, row, keys, poss, t, need, 0, 2, CBLOCK)
    thresh = (t.to(tl.uint32) << 2) | d.to(tl.uint32)  # T, the k-th largest key
    thresh = tl.where(refine, thresh, 0)  # T = 0: every valid key is above it
    need = tl.where(refine, need, 0)  # how many keys equal to T are taken, lowest positions first

    n_sel = tl.zeros([], dtype=tl.int32)
    n_tie = tl.zeros([], dtype=tl.int32)
    out_ptr += b * stride_ob
    for off in range(0, tl.maximum(n_list, n_row), CBLOCK):
        i = off + tl.arange(0, CBLOCK)
        key, pos = _load_candidates(i, n_list, n_row, row, keys, poss)
        valid_i = key != 0
        tie = (valid_i & (key == thresh)).to(tl.int32)
        tie_rank = n_tie + tl.cumsum(tie, 0) - 1
        take = (valid_i & (key > thresh)) | ((tie != 0) & (tie_rank < need))
        take_i = take.to(tl.int32)
        slot = n_sel + tl.cumsum(take_i, 0) - 1  # the candidates are in position order: so is the output
        tl.store(out_ptr + slot, pos.to(tl.int64), mask=take)
        n_sel += tl.sum(take_i, 0)
        n_tie += tl.sum(tie, 0)
    for off in range(0, k, CBLOCK):  # -1 after the selection (rows with fewer than k valid positions)
        j = off + tl.arange(0, CBLOCK)
        tl.store(out_ptr + j, tl.full([CBLOCK], -1, tl.int64), mask=(j >= n_sel) & (j < k))


def topk_triton(
    scores: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    *,
    seg: int = SEG,
    block: int = BLOCK,
    cblock: int = CBLOCK,
    sample: int = SAMPLE,
    margin: int = MARGIN,
    out: torch.Tensor | None = None,
    max_rows: int = MAX_ROWS,
) -> torch.Tensor:
    """Exact top-k of each row of scores [B, L] fp32 over its first lens[b] positions (lens [B]).

    Returns indices [B, k] int64: the positions `naive.topk_select(scores, lens - 1, k)` selects (score desc,
    then position asc; NaN invalid; every valid position when fewer than k), in ascending position order,
    then -1.
    `seg`, `block`, `cblock`, `sample` (powers of two, block <= seg, sample >= 8) are tile sizes, `margin`
    the sample's extra ranks and `max_rows` the rows per launch; tests shrink them. `out` [B, k] int64, when
    given, receives the result.
    """
    B, L = scores.shape
    assert scores.dtype == torch.float32, f"scores must be fp32, got {scores.dtype}"
    assert lens.shape == (B,), f"lens {tuple(lens.shape)} != {(B,)}"
    assert k >= 1 and L < 2**31
    assert block <= seg and seg % block == 0 and sample >= RUN and sample % RUN == 0
    device = scores.device
    if out is None:
        out = torch.empty(B, k, dtype=torch.int64, device=device)  # [B, k]
    assert out.shape == (B, k) and out.dtype == torch.int64 and out.stride(-1) == 1
    if B == 0:
        return out
    tiles = dict(seg=seg, block=block, cblock=cblock, sample=sample, margin=margin)
    if B > max_rows:  # one launch per block of rows (a training step scores ~10^5 query rows)
        for i in range(0, B, max_rows):
            j = min(i + max_rows, B)
            topk_triton(scores[i:j], lens[i:j], k, out=out[i:j], **tiles)
        return out
    if L == 0:
        return out.fill_(-1)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    lens = lens.to(torch.int64)
    num_segs = triton.cdiv(L, seg)
    counts = torch.empty(B, num_segs, dtype=torch.int32, device=device)  # [B, S]
    lo = torch.empty(B, dtype=torch.int32, device=device)  # [B]
    LC = triton.cdiv(L, 16) * 16  # candidate rows padded for vectorized loads
    cand_key = torch.empty(B, LC, dtype=torch.int32, device=device)  # [B, LC], segment s's from s x seg
    cand_pos = torch.empty(B, LC, dtype=torch.int32, device=device)  # [B, LC]
    _threshold_kernel[(B,)](
        scores, lens, lo, L, k, scores.stride(0),
        SAMPLE=sample, RUN=RUN, MARGIN=margin, NB=2**SAMPLE_BITS, BITS=SAMPLE_BITS, num_warps=NUM_WARPS,
    )  # fmt: skip
    common = (L, LC, num_segs, k, scores.stride(0))
    _filter_kernel[(num_segs, B)](
        scores, lens, counts, lo, cand_key, cand_pos, *common, SEG=seg, BLOCK=block, num_warps=NUM_WARPS
    )  # fmt: skip
    _select_kernel[(B,)](
        scores, lens, counts, lo, cand_key, cand_pos, out, *common, out.stride(0),
        SEG=seg, CBLOCK=cblock, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
