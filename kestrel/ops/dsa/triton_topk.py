"""Exact row-wise top-k for DSA in Triton (cuda_topk's CUDA kernel, the default on CUDA, makes the same selection
in 0.46x this one's time on the H200 at 64 x 131072 and 0.55-0.67x at the prefill and training shapes; this one
serves with KESTREL_DSA_TOPK=triton, where nvcc is missing, and on CPU under the interpreter):
`topk_triton(scores, lens, k)` selects the same positions as `naive.topk_select(scores, lens - 1, k)`, listed in
position order instead of rank order (every consumer, the sparse attention and the training mask, uses the set;
position order also reads the KV pages in order).

Legend: B rows, L scores per row, k = index_topk, S = cdiv(L, SEG) segments per row, C candidates of a row
(positions that survive the first radix pass).

The order. Each score maps to a 32-bit key whose unsigned order is the float order (-0.0 is first made +0.0,
so the two tie as IEEE equality says); a NaN or a position >= lens[b] gets key 0, below every valid key
(a valid -inf is 0x007FFFFF). (key desc, position asc) is then a strict total order, the tie rule of
naive.py, and the selection is its first min(k, valid) elements, listed by position, then -1.

Radix select on the key, 6 + 5 bits over the row, then 6 + 5 + 5 + 5 over the candidates, in four kernels
(no host syncs, so CUDA-graph safe):

1. `_coarse_kernel`, grid (S, B): each program histograms the top 6 key bits of its SEG scores (valid ones
   only) and adds the histogram into the row's [64] bins (atomics, integer so deterministic).
   `_fine_kernel`, grid (S, B): every program finds the coarse threshold bin t1 (the largest bin with >= k
   valid keys at or above it), histograms the next 5 bits of its keys in bin t1 into the row's [32] bins, and
   stores its own suffix counts over those 32 bins and its count of keys above t1, for step 2's offsets.
   Together they give the 11-bit threshold bin b1 = (t1, t2) of the k-th largest key (all valid keys when
   the row has <= k).
2. `_compact_kernel`, grid (S, B): every program finds b1 from the two row histograms and copies the
   (key, position) of its keys in bins >= b1 to a per-row candidate list, in position order: its offset
   is the sum of the earlier segments' counts at b1, and a cumsum orders the block.
3. `_select_kernel`, grid (B,): refines the threshold inside bin b1 over the candidates only (bits 20..15,
   14..10, 9..5 and 4..0: one small histogram each), giving the exact k-th key T and how many keys equal to
   T are needed; writes every candidate above T and the first `need` ties at T (the candidates are in
   position order, so these are the lowest positions: the tie rule), in that position order; no sort.

Why small histograms (steps 1 and 3) instead of 2048 bins: `tl.histogram` costs about (bins / 32) x log2(bins)
operations per element, and the one-pass 11-bit histogram measured 295 of the 416 us of 64 rows x 131072 on the
H200 (2026-11-30; torch.topk: 192 us), and step 3 (then a 2048-bin and a 1024-bin pass) 50 us. 64 and 32
bins cost ~1/50 of that per element, for more reads (the row's second from L2 when the batch fits in it, the
candidates' from L1/L2). Not yet timed on the GPU.

Memory traffic per row of L = 131072 (512 KiB of scores), k = 2048: step 1 reads the valid prefix of the row
twice and step 2 once (3 x 512 KiB, the later reads mostly from L2); step 1 writes S x 132 B of counts; step 2
writes 8 B per candidate (C is k plus one quarter-octave bin, typically 3-6 K positions: ~40 KiB); step 3
reads the candidates at most five times and writes 16 KiB of indices. About 1.7 MiB per row.

For 64 rows that is ~110 MB, ~26 us at the 4.25 TB/s copy ceiling, plus five launches (a memset and four
kernels) and step 3's serial latency (five dependent passes over the candidates per row). Until 2026-11-30
step 3 also bitonic-sorted the selection into rank order (dropped: no consumer needs it).
Loads of scores and candidates are 16-byte vectors when L % 16 == 0 (any page-multiple width).

Scratch: 8 B per score for the candidate list (its worst case, all scores equal, keeps the whole row),
S x 132 B of counts and 384 B of histograms per row.

Fusion left for later: step 1a can run in the epilogue of the indexer-scores kernel (it sees every score
once), which removes one full read of the row.

Tried and measured on the H200 (2026-12-01, session 14; commits e3ecd25 and 342fae4), then reverted:
a sampled threshold in place of steps 1a and 1b (4096 scores of each row in runs of 8, the rank
r + 4 sqrt(r) + 16 of the k-th largest's expected rank r), one filtering read of the row, and a select that
falls back to the row when the sample overshoots. With the sample and two 256-bin digits in every step-2
program and 8-bit digits in step 3: 147.6 us (filter 73.7, select 52.5). With the sample in its own kernel
(three 32-bin digits: 5.8 us) and 5-bit digits: 113.1 us against this version's 119.9 in the same run
(torch.topk 189-192), but filter 46.6 us (the compaction without the histograms costs more than here) and
select 41.3 us (seven dependent passes, ~5 us each), and the 8 x 4096 prefill's top-k took 26.9 ms against
19.9. What it taught: `tl.histogram` costs about bins / 32 units per key bit (256 bins: 8x the cost of 32
bins per bit), and step 3 is bound by its number of dependent passes, not their width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NB1, NB2 = 64, 32  # step 1: the top 6 key bits, then the next 5 inside the threshold bin (11 bits in all)
SEG = 16384  # scores per program in steps 1 and 2
BLOCK = 4096  # scores per loop iteration in steps 1 and 2
CBLOCK = 4096  # candidates per loop iteration in step 3
MAX_ROWS = 32768  # rows per launch: the grid's second dimension stops at 65535 (and bounds the scratch)
NUM_WARPS = 8  # sm_90, Triton 3.6: 52 / 64 / 113 / 128 registers (scripts/triton_sm90_check.py), no spills


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
def _coarse_kernel(
    scores_ptr,  # [B, L] fp32
    lens_ptr,  # [B] int64
    hist1_ptr,  # [B, NB1] int32, zeroed
    L,
    stride_sb,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    NB1: tl.constexpr,
):
    """Step 1a: the row's histogram of the top 6 key bits (its SEG scores per program, atomics)."""
    seg = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + b), L)
    start = seg * SEG
    end = tl.minimum(start + SEG, n)  # only the valid prefix is read
    hist = tl.zeros([NB1], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        p = off + tl.arange(0, BLOCK)  # [BLOCK]
        # Masking the load by the row width rather than by lens keeps it vectorized when L % 16 == 0.
        x = tl.load(scores_ptr + b * stride_sb + p, mask=p < L, other=float("nan"))
        key = _sort_key(x, p < end)
        hist += tl.histogram((key >> 26).to(tl.int32), NB1, mask=key != 0)
    bins = tl.arange(0, NB1)
    tl.atomic_add(hist1_ptr + b * NB1 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _fine_kernel(
    scores_ptr,  # [B, L] fp32
    lens_ptr,  # [B] int64
    hist1_ptr,  # [B, NB1] int32
    hist2_ptr,  # [B, NB2] int32, zeroed
    seg_count_ptr,  # [B, S, NB2 + 1] int32
    L,
    num_segs,
    k,
    stride_sb,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    NB1: tl.constexpr,
    NB2: tl.constexpr,
):
    """Step 1b: inside the coarse threshold bin t1, the row's histogram of the next 5 key bits; each program
    stores its suffix counts over those bins and, last, its count of keys in coarse bins above t1."""
    seg = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + b), L)
    t1, _ = _threshold_bin(tl.load(hist1_ptr + b * NB1 + tl.arange(0, NB1)), k, NB1)
    start = seg * SEG
    end = tl.minimum(start + SEG, n)
    hist = tl.zeros([NB2], dtype=tl.int32)
    above = tl.zeros([], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        p = off + tl.arange(0, BLOCK)
        x = tl.load(scores_ptr + b * stride_sb + p, mask=p < L, other=float("nan"))
        key = _sort_key(x, p < end)
        top = (key >> 26).to(tl.int32)
        hist += tl.histogram(((key >> 21) & (NB2 - 1)).to(tl.int32), NB2, mask=(key != 0) & (top == t1))
        above += tl.sum(((key != 0) & (top > t1)).to(tl.int32), 0)
    bins = tl.arange(0, NB2)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [NB2]
    row = seg_count_ptr + (b * num_segs + seg) * (NB2 + 1)
    tl.store(row + bins, at_or_above)
    tl.store(row + NB2, above)
    tl.atomic_add(hist2_ptr + b * NB2 + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _row_threshold(hist1_ptr, hist2_ptr, b, k, NB1: tl.constexpr, NB2: tl.constexpr):
    """(b1, t2, above, total) of row b: b1 = t1 * NB2 + t2, the 11-bit bin of the k-th largest key (the largest
    bin with >= k valid keys at or above it; 0 when the row has <= k), t2 its 5-bit part, `above` the valid
    keys in bins above b1, `total` the row's valid keys."""
    h1 = tl.load(hist1_ptr + b * NB1 + tl.arange(0, NB1))
    t1, above1 = _threshold_bin(h1, k, NB1)
    t2, above2 = _threshold_bin(tl.load(hist2_ptr + b * NB2 + tl.arange(0, NB2)), k - above1, NB2)
    return t1 * NB2 + t2, t2, above1 + above2, tl.sum(h1, 0)


@triton.jit
def _compact_kernel(
    scores_ptr,  # [B, L] fp32
    lens_ptr,  # [B] int64
    hist1_ptr,  # [B, NB1] int32
    hist2_ptr,  # [B, NB2] int32
    seg_count_ptr,  # [B, S, NB2 + 1] int32
    cand_key_ptr,  # [B, LC] int32 (uint32 keys)
    cand_pos_ptr,  # [B, LC] int32
    L,
    LC,
    num_segs,
    k,
    stride_sb,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    NB1: tl.constexpr,
    NB2: tl.constexpr,
    SP: tl.constexpr,
):
    seg = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + b), L)
    b1, t2, _, _ = _row_threshold(hist1_ptr, hist2_ptr, b, k, NB1, NB2)
    s = tl.arange(0, SP)
    rows = seg_count_ptr + (b * num_segs + s) * (NB2 + 1)
    counts = tl.load(rows + t2, mask=s <= seg, other=0) + tl.load(rows + NB2, mask=s <= seg, other=0)  # [SP]
    base = tl.sum(tl.where(s < seg, counts, 0), 0)  # candidates of the earlier segments
    mine = tl.sum(tl.where(s == seg, counts, 0), 0)
    start = seg * SEG
    end = tl.where(mine > 0, tl.minimum(start + SEG, n), start)  # a segment without candidates reads nothing
    for off in range(start, end, BLOCK):
        p = off + tl.arange(0, BLOCK)  # [BLOCK]
        x = tl.load(scores_ptr + b * stride_sb + p, mask=p < L, other=float("nan"))
        key = _sort_key(x, p < end)
        take = (key != 0) & ((key >> 21).to(tl.int32) >= b1)
        take_i = take.to(tl.int32)
        slot = b * LC + base + tl.cumsum(take_i, 0) - 1  # position order within the row's list
        tl.store(cand_key_ptr + slot, key.to(tl.int32, bitcast=True), mask=take)
        tl.store(cand_pos_ptr + slot, p, mask=take)
        base += tl.sum(take_i, 0)


@triton.jit
def _refine(
    cand_key_ptr,
    n_scan,
    n_cand,
    prefix,
    need,
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    NBD: tl.constexpr,  # 2 ** BITS
    CBLOCK: tl.constexpr,
):
    """One radix digit of T: among the candidates whose key bits above SHIFT + BITS equal `prefix`, the digit
    (key bits SHIFT + BITS - 1 .. SHIFT) holding the need-th largest key. Returns (that digit, need less the
    keys in higher digits)."""
    h = tl.zeros([NBD], dtype=tl.int32)
    for off in range(0, n_scan, CBLOCK):
        i = off + tl.arange(0, CBLOCK)
        key = tl.load(cand_key_ptr + i, mask=i < n_scan, other=0).to(tl.uint32, bitcast=True)
        inside = (i < n_cand) & ((key >> (SHIFT + BITS)).to(tl.int32) == prefix)
        h += tl.histogram(((key >> SHIFT) & (NBD - 1)).to(tl.int32), NBD, mask=inside)
    digit, above = _threshold_bin(h, need, NBD)
    return digit, need - above


@triton.jit
def _select_kernel(
    hist1_ptr,  # [B, NB1] int32
    hist2_ptr,  # [B, NB2] int32
    seg_count_ptr,  # [B, S, NB2 + 1] int32
    cand_key_ptr,  # [B, LC] int32
    cand_pos_ptr,  # [B, LC] int32
    out_ptr,  # [B, k] int64
    LC,
    num_segs,
    k,
    stride_ob,
    NB1: tl.constexpr,
    NB2: tl.constexpr,
    SP: tl.constexpr,
    CBLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    b1, t2, above1, total = _row_threshold(hist1_ptr, hist2_ptr, b, k, NB1, NB2)
    s = tl.arange(0, SP)
    rows = seg_count_ptr + (b * num_segs + s) * (NB2 + 1)
    n_cand = tl.sum(
        tl.load(rows + t2, mask=s < num_segs, other=0) + tl.load(rows + NB2, mask=s < num_segs, other=0), 0
    )
    cand_key_ptr += b * LC
    cand_pos_ptr += b * LC
    # Loads masked at a multiple of 16 stay vectorized (the rows are padded to LC); `i < n_cand` masks the rest.
    n_load = (n_cand + 15) // 16 * 16

    # Refine the threshold inside bin b1; with <= k valid positions all are taken and the passes are skipped.
    refine = total > k
    n_scan = tl.where(refine, n_load, 0)
    need = k - above1
    # The remaining 21 bits of T, 6 + 5 + 5 + 5 at a time: small histograms are cheap (see step 1).
    d, need = _refine(cand_key_ptr, n_scan, n_cand, b1, need, 15, 6, 64, CBLOCK)
    p17 = b1 * 64 + d  # the top 17 key bits of T
    d, need = _refine(cand_key_ptr, n_scan, n_cand, p17, need, 10, 5, 32, CBLOCK)
    p22 = p17 * 32 + d
    d, need = _refine(cand_key_ptr, n_scan, n_cand, p22, need, 5, 5, 32, CBLOCK)
    p27 = p22 * 32 + d
    d, need = _refine(cand_key_ptr, n_scan, n_cand, p27, need, 0, 5, 32, CBLOCK)
    thresh = (p27.to(tl.uint32) << 5) | d.to(tl.uint32)  # T, the k-th largest key (32 bits: unsigned)
    thresh = tl.where(refine, thresh, 0)  # T = 0: every valid key is above it
    need = tl.where(refine, need, 0)  # how many keys equal to T are taken, lowest positions first

    n_sel = tl.zeros([], dtype=tl.int32)
    n_tie = tl.zeros([], dtype=tl.int32)
    out_ptr += b * stride_ob
    for off in range(0, n_load, CBLOCK):
        i = off + tl.arange(0, CBLOCK)
        m = i < n_cand
        key = tl.load(cand_key_ptr + i, mask=i < n_load, other=0).to(tl.uint32, bitcast=True)
        pos = tl.load(cand_pos_ptr + i, mask=i < n_load, other=0)
        tie = (m & (key == thresh)).to(tl.int32)
        tie_rank = n_tie + tl.cumsum(tie, 0) - 1
        take = (m & (key > thresh)) | ((tie != 0) & (tie_rank < need))
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
    out: torch.Tensor | None = None,
    max_rows: int = MAX_ROWS,
) -> torch.Tensor:
    """Exact top-k of each row of scores [B, L] fp32 over its first lens[b] positions (lens [B]).

    Returns indices [B, k] int64: the positions `naive.topk_select(scores, lens - 1, k)` selects (score desc,
    then position asc; NaN invalid; every valid position when fewer than k), in ascending position order,
    then -1.
    `seg`, `block`, `cblock` (powers of two, block <= seg) are tile sizes and `max_rows` the rows per launch;
    tests shrink them. `out` [B, k]
    int64, when given, receives the result.
    """
    B, L = scores.shape
    assert scores.dtype == torch.float32, f"scores must be fp32, got {scores.dtype}"
    assert lens.shape == (B,), f"lens {tuple(lens.shape)} != {(B,)}"
    assert k >= 1 and L < 2**31
    assert block <= seg and seg % block == 0
    device = scores.device
    if out is None:
        out = torch.empty(B, k, dtype=torch.int64, device=device)  # [B, k]
    assert out.shape == (B, k) and out.dtype == torch.int64 and out.stride(-1) == 1
    if B == 0:
        return out
    if B > max_rows:  # one launch per block of rows (a training step scores ~10^5 query rows)
        for i in range(0, B, max_rows):
            j = min(i + max_rows, B)
            topk_triton(scores[i:j], lens[i:j], k, seg=seg, block=block, cblock=cblock, out=out[i:j])
        return out
    if L == 0:
        return out.fill_(-1)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    lens = lens.to(torch.int64)
    num_segs = triton.cdiv(L, seg)
    SP = max(2, triton.next_power_of_2(num_segs))
    hists = torch.zeros(B * (NB1 + NB2), dtype=torch.int32, device=device)  # both histograms: one memset
    hist1, hist2 = hists[: B * NB1].view(B, NB1), hists[B * NB1 :].view(B, NB2)  # [B, NB1], [B, NB2]
    seg_count = torch.empty(B, num_segs, NB2 + 1, dtype=torch.int32, device=device)  # [B, S, NB2 + 1]
    LC = triton.cdiv(L, 16) * 16  # candidate rows padded for vectorized loads
    cand_key = torch.empty(B, LC, dtype=torch.int32, device=device)  # [B, LC], the first C used
    cand_pos = torch.empty(B, LC, dtype=torch.int32, device=device)  # [B, LC]

    _coarse_kernel[(num_segs, B)](
        scores, lens, hist1, L, scores.stride(0), SEG=seg, BLOCK=block, NB1=NB1, num_warps=NUM_WARPS
    )
    _fine_kernel[(num_segs, B)](
        scores,
        lens,
        hist1,
        hist2,
        seg_count,
        L,
        num_segs,
        k,
        scores.stride(0),
        SEG=seg,
        BLOCK=block,
        NB1=NB1,
        NB2=NB2,
        num_warps=NUM_WARPS,
    )
    _compact_kernel[(num_segs, B)](
        scores,
        lens,
        hist1,
        hist2,
        seg_count,
        cand_key,
        cand_pos,
        L,
        LC,
        num_segs,
        k,
        scores.stride(0),
        SEG=seg,
        BLOCK=block,
        NB1=NB1,
        NB2=NB2,
        SP=SP,
        num_warps=NUM_WARPS,
    )
    _select_kernel[(B,)](
        hist1,
        hist2,
        seg_count,
        cand_key,
        cand_pos,
        out,
        LC,
        num_segs,
        k,
        out.stride(0),
        NB1=NB1,
        NB2=NB2,
        SP=SP,
        CBLOCK=cblock,
        num_warps=NUM_WARPS,
    )
    return out
