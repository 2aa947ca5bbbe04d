"""Sparse (DSA) and dense MLA decode in absorbed form over the paged latent cache, in Triton.

Legend: B sequences (one query each), H heads, R kv_lora_rank, P rope dims (never rotated in Kimi), Dn nope
dims, Dv v dims, k selected positions per sequence, S splits of the position list, maxp pages per sequence.

The math is `mla_decode_batched` (kestrel.ops.mla.naive), absorbed (model-spec 2.2):
    q_lat^h = W_UK^h^T q_nope^h                       [R]       torch bmm, outside the kernel
    s_j^h   = (q_lat^h . c_kv_j + q_pe^h . k_pe_j) * scale      over the selected positions j
    o_lat^h = sum_j softmax_j(s^h) c_kv_j             [R]       this kernel
    o^h     = W_UV^h o_lat^h                          [Dv]      torch bmm, outside the kernel
All heads read the same latent rows, so one program takes one sequence and a block of heads and loads each
selected row [c_kv | k_pe] once for all of them: the scores are a [heads, BLOCK_N] matmul and the output a
[heads, R] one, both on tensor cores. Position -> pool row goes through the page table
(row = page_table[b, pos // page_size] * page_size + pos % page_size, kestrel.cache.kv_pool); with a selection,
`selected_rows` does that in a pass of its own first, so that each tile's row loads wait on one load, not two
chained (1.6x at batch 256 on the H200), unless they come made already (`rows=`: the CUDA top-k writes them in
its own launch with KESTREL_DSA_TOPK_ROWS=on, kestrel.layers.mla). An index of -1
(or any negative), or a position >= lens[b], is skipped: its row is never read, so whatever it holds (NaN
included) cannot reach the output. Valid indices must be distinct within a row (top-k gives that); a repeated
one would count twice, where the reference counts it once. With indices=None the program runs over positions
0..lens[b]-1: the dense path for contexts shorter than the top-k, where the selection would be everything.

Softmax is online (running max and sum in fp32, base 2), accumulation in fp32. With S > 1 splits, program (head
block, b, s) covers a contiguous chunk of the position list (dense: of the sequence's own lens[b] positions,
whatever the page table's width) and writes its normalized partial output and log-sum-exp; a second kernel merges
the S partials of each (b, h) by log-sum-exp weights. S is chosen from the static shapes only (B, heads, k or
maxp * page_size), so a CUDA graph captures a fixed launch; batch 1 needs it to put more than one SM to work. A
sequence with lens[b] = 0 (CUDA-graph padding) gets zeros.

Bytes per decode step per DSA layer, `mini` (H=16, R=512, P=64, Dn=Dv=128, k=2048, bf16 cache, page 64,
int64 indices and page table), from `decode_bytes` below; "kernel" = latent rows + indices + page-table
entries + q_lat/q_pe read + o_lat written; "+W" adds W_UK and W_UV (4 MiB) and the bmm activations:

    sparse, top-2048      kernel bytes   floor @4.25 TB/s   with W_UK/W_UV   floor
    B=1,   c=4K           2.41 MB          0.57 us          6.65 MB          1.56 us
    B=1,   c=128K         2.43 MB          0.57 us          6.66 MB          1.57 us
    B=64,  c=4K           154.3 MB        36.3 us           161.1 MB        37.9 us
    B=64,  c=128K         155.3 MB        36.5 us           162.1 MB        38.1 us
    B=256, c=4K           617.2 MB       145.2 us           631.9 MB       148.7 us
    B=256, c=128K         621.3 MB       146.2 us           636.0 MB       149.6 us
    dense (contrast)
    B=1,   c=4K           4.75 MB          1.12 us
    B=1,   c=128K         151.0 MB        35.5 us
    B=64,  c=4K           304.3 MB        71.6 us
    B=64,  c=128K         9.67 GB          2.27 ms
    B=256, c=4K           1.22 GB        286.4 us
    B=256, c=128K         38.7 GB          9.10 ms

Per token and row the latent row is 576 x 2 B = 1152 B, and a top-2048 read is 2.36 MB per sequence whatever
the context (the page-table entries are the only part that grows: 512 B at 4K, <= 16 KB at 128K), so the
sparse kernel's floor at 128K is within 1 % of its floor at 4K; the context-dependent DSA cost is the indexer.
Multiply by 6 DSA layers for a step (B=64: 6 x 37.9 us = 227 us of attention bytes). At B=1 the floor (under
2 us a layer) is below the launch cost of the 3-4 kernels (absorb bmm, decode, combine, W_UV bmm), so batch-1
speed is set by launches and CUDA graphs, not bytes. Splitting adds S x H x R x 4 B x 2 (write + read) per
sequence of partials: 1 MB at B=1 (S=16), 0.26 MB (11 %) at B=64 (S=4), none above B=132 (the SM count); the
partials are written and read back at once, so they mostly stay in the 50 MB L2.
FLOPs: 2 x H x k x (2R + P) = 71 MFLOP per sequence, 30 FLOP/byte at H=16, far below the H200's ~184 ridge:
the kernel is bandwidth-bound at every batch. K3 (H=96 or its TP share) only changes the head blocks: each
block of 32 heads re-reads the rows, neighbouring blocks of one sequence run side by side for L2 hits.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_begin

MIN_POSITIONS_PER_SPLIT = 128  # below this a split's fixed cost (partials, merge) outweighs the parallelism
MAX_SPLITS = 64


MAX_ROWS = 32768  # queries per launch: the grid's second dimension stops at 65535


@triton.jit
def _pool_row(page_table_ptr, b, stride_ptb, pos, valid, page_size):
    """Pool rows of positions pos [BN] of sequence b through its page table (0 where not valid), int64. The
    page index in int32 (positions are < 2**31): int64 division and modulo take many more instructions."""
    pos = tl.where(valid, pos, 0).to(tl.int32)
    page = tl.load(page_table_ptr + b * stride_ptb + pos // page_size, mask=valid, other=0)
    return page.to(tl.int64) * page_size + pos % page_size  # int64: pools pass 2**31 B


@triton.jit
def _rows_kernel(
    indices_ptr, page_table_ptr, lens_ptr, rows_ptr, K, page_size, stride_ib, stride_ptb, stride_rb,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """rows[b, j] = the pool row of position indices[b, j], or -1 where that entry is not used (< 0 or >=
    lens[b])."""
    pdl_begin(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < K
    pos = tl.load(indices_ptr + b * stride_ib + j, mask=ok, other=-1)
    valid = ok & (pos >= 0) & (pos < tl.load(lens_ptr + b))
    row = _pool_row(page_table_ptr, b, stride_ptb, pos, valid, page_size)
    tl.store(rows_ptr + b * stride_rb + j, tl.where(valid, row, -1).to(rows_ptr.dtype.element_ty), mask=ok)


def selected_rows(
    indices: torch.Tensor, page_table: torch.Tensor, page_size: int, lens: torch.Tensor
) -> torch.Tensor:
    """Pool rows [B, k] int32 of the selected positions indices [B, k] (-1 where an entry is unused: negative,
    or >= lens[b]): row = page_table[b, pos // page_size] * page_size + pos % page_size. One pass before the
    decode kernel, so that its tile loads wait on one load (the row) instead of two chained (index, page):
    on the H200 at mini's sizes that took batch 256 from 373 to 234 us a layer (session 20,
    scripts/decode_kernels_check.py's mla_layout)."""
    B, K = indices.shape
    rows = torch.empty(B, K, dtype=torch.int32, device=indices.device)
    if B and K:
        block = min(1024, triton.next_power_of_2(K))
        _rows_kernel[(B, triton.cdiv(K, block))](
            indices, page_table, lens, rows, K, page_size, indices.stride(0), page_table.stride(0), rows.stride(0),
            BLOCK=block, **pdl_args(rows),
        )  # fmt: skip
    return rows


@triton.jit
def _decode_kernel(
    q_lat_ptr,
    q_pe_ptr,
    kv_ptr,
    page_table_ptr,
    lens_ptr,
    indices_ptr,
    out_ptr,
    lse_ptr,
    H,
    R,
    P,
    num_positions,
    chunk,
    page_size,
    qk_scale,  # scale * log2(e): scores in base 2
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_kv,
    stride_ptb,
    stride_ib,
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_ls,
    HAS_INDICES: tl.constexpr,
    ROWS: tl.constexpr,
    VALID_FIRST: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    hb = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    offs_r = tl.arange(0, BLOCK_R)  # [BR]
    offs_p = tl.arange(0, BLOCK_P)  # [BP]
    h_ok = heads < H
    r_ok = offs_r < R
    p_ok = offs_p < P
    if DOT_F32:
        dot_dtype = tl.float32
    else:
        dot_dtype = kv_ptr.dtype.element_ty

    q_lat = tl.load(
        q_lat_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_r[None, :],
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    ).to(dot_dtype)  # [BH, BR]
    q_pe = tl.load(
        q_pe_ptr + b * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
        mask=h_ok[:, None] & p_ok[None, :],
        other=0.0,
    ).to(dot_dtype)  # [BH, BP]

    seq_len = tl.load(lens_ptr + b)
    if HAS_INDICES:
        start = s * chunk
        end = tl.minimum(start + chunk, num_positions)
        if VALID_FIRST:
            # indices with their valid entries first: those are distinct positions < seq_len, so none sits at a
            # slot >= seq_len (a prefill row near the start skips the rest)
            end = tl.minimum(end, seq_len)
    else:
        # dense: the splits share the sequence's own positions, whatever the page table's width (decode's graphs
        # are as wide as the engine's longest context; a chunk of the width left a short sequence to its first
        # split or two). Positions in int32: int64 ones make the page index's division and modulo 64-bit.
        n_pos = tl.minimum(seq_len, num_positions).to(tl.int32)
        chunk_b = tl.cdiv(tl.cdiv(n_pos, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        start = s * chunk_b
        end = tl.minimum(start + chunk_b, n_pos)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)  # [BN] slots of the position list
        in_chunk = j < end
        if ROWS:  # the pool rows themselves (`selected_rows`), -1 = unused: one load before the tile's rows
            row = tl.load(indices_ptr + b * stride_ib + j, mask=in_chunk, other=-1).to(tl.int64)
            valid = row >= 0
            row = tl.where(valid, row, 0)
        else:
            if HAS_INDICES:
                pos = tl.load(indices_ptr + b * stride_ib + j, mask=in_chunk, other=-1)
            else:
                pos = j
            valid = in_chunk & (pos >= 0) & (pos < seq_len)
            row = _pool_row(page_table_ptr, b, stride_ptb, pos, valid, page_size)  # [BN] pool rows
        row_ptr = kv_ptr + row[:, None] * stride_kv
        c_kv = tl.load(row_ptr + offs_r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
        c_kv = c_kv.to(dot_dtype)  # [BN, BR]
        k_pe = tl.load(row_ptr + R + offs_p[None, :], mask=valid[:, None] & p_ok[None, :], other=0.0)
        k_pe = k_pe.to(dot_dtype)  # [BN, BP]

        qk = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)  # [BH, BN]
        qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision=DOT_PRECISION)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # [BH]
        # While nothing has been seen m stays -inf; shift by 0 then so that exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)  # [BH]
        p = tl.exp2(qk - m_shift[:, None])  # [BH, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), c_kv, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BH, BR]; zeros where nothing was seen
    out_ptrs = out_ptr + b * stride_ob + s * stride_os + heads[:, None] * stride_oh + offs_r[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BH]
        tl.store(lse_ptr + b * stride_lb + s * stride_ls + heads, lse, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    R,
    num_splits,
    stride_pb,
    stride_ps,
    stride_ph,
    stride_lb,
    stride_ls,
    stride_ob,
    stride_oh,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    lse_base = lse_ptr + b * stride_lb + h
    m = tl.full([], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(lse_base + s * stride_ls))
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(lse_base + s * stride_ls) - m_shift)  # 0 for an empty split
        part = tl.load(
            part_ptr + b * stride_pb + s * stride_ps + h * stride_ph + offs_r, mask=r_ok, other=0.0
        )
        # An empty split stores zeros, but test w so that a split's output never matters at weight 0.
        acc += tl.where(w > 0.0, w * part, 0.0)
        total += w
    o = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, o.to(out_ptr.dtype.element_ty), mask=r_ok)


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory a block may opt into) of `device`; elsewhere (the interpreter, where they only
    pick a split count and a tile) the H200's: 132 SMs, 227 KB."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.multi_processor_count, props.shared_memory_per_block_optin
    return 132, 232448


def head_block(num_heads: int) -> int:
    """Heads per program: 16 (the smallest tensor-core M) up to 32 (a [32, 512] fp32 accumulator in 8 warps)."""
    return 16 if num_heads <= 16 else 32


def choose_num_splits(batch: int, num_heads: int, num_positions: int, num_sms: int) -> int:
    """Splits of the position list: enough programs for about two per SM, but no split shorter than
    MIN_POSITIONS_PER_SPLIT positions. Depends on static shapes only (CUDA graphs)."""
    programs = batch * triton.cdiv(num_heads, head_block(num_heads))
    want = max(1, (2 * num_sms) // max(programs, 1))
    most = max(1, num_positions // MIN_POSITIONS_PER_SPLIT)
    return min(want, most, MAX_SPLITS)


def choose_tile(
    num_splits: int, block_h: int, row_bytes: int, rows_first: bool, smem_bytes: int
) -> tuple[int, int]:
    """(block_n, num_stages) of the decode kernel. Unsplit launches over pool rows translated first (`selected_rows`)
    of 16-head blocks take 64-row tiles three deep where three such tiles of row_bytes (R + P elements) fit in
    smem_bytes (the device's shared memory a block, less 8 KB for the rest): at mini's sizes (bf16, 1152 B a row:
    216 KB, which the H200's 227 KB hold, an A100's 164 KB not), batch 256, 179 us a layer against 228 for 32
    rows two deep (session 20, the launch sweep of scripts/decode_kernels_check.py). Everything else keeps 32
    two deep: split launches (at batch 1, 16 splits of 128 positions, 64 three deep took 202 us against 70; at
    batch 64 the best, 68 us, was within the run's noise of the default's 78), and the loops that still go
    through the page table inside (dense, rows_first=False), where 64-row tiles were slower (344 -> 397 us over
    consecutive pages, 369 -> 425 chained, batch 256)."""
    if num_splits == 1 and block_h == 16 and rows_first and 3 * 64 * row_bytes + 8192 <= smem_bytes:
        return 64, 3
    return 32, 2


def _partials(
    batch: int, num_splits: int, num_heads: int, rank: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split workspace: normalized partial outputs [B, S, H, R] fp32 and their base-2 log-sum-exp [B, S, H]."""
    part = torch.empty(batch, num_splits, num_heads, rank, dtype=torch.float32, device=device)
    lse = torch.empty(batch, num_splits, num_heads, dtype=torch.float32, device=device)
    return part, lse


def sparse_mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    lens: torch.Tensor,
    indices: torch.Tensor | None,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_rows: int = MAX_ROWS,
    valid_first: bool = False,
    rows_first: bool = True,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent-space attention of one query per sequence over its selected cache rows; no host syncs.

    q_lat [B, H, R] (absorbed query W_UK^T q_nope, any strides with unit last stride), q_pe [B, H, P],
    kv_pool [rows, R + P] (one layer's pool, [c_kv | k_pe] per row), page_table [B, maxp] (padded with page 0),
    lens [B] (the query sits at position lens[b] - 1), indices [B, k] positions (-1 = unused; entries
    >= lens[b] are ignored) or None for dense over 0..lens[b]-1. Returns o_lat [B, H, R] in out_dtype
    (default q_lat.dtype), or into `out`; the caller applies W_UV (o^h = W_UV^h o_lat^h).
    num_splits None = choose_num_splits; block_n (positions per tile) and num_stages None = choose_tile;
    max_rows queries per launch (prefill runs every token as a row, and the grid's second dimension stops at
    65535). valid_first: each row of indices lists its valid entries before any -1 (the DSA top-k's layout), so
    a row stops at slot lens[b].
    rows_first: with indices, translate them to pool rows in a pass of their own first (`selected_rows`).
    rows: those pool rows already made, [B, k] int32 (unit column stride; `selected_rows(indices, page_table,
    page_size, lens)`, or the CUDA top-k's `topk_cuda_with_rows` from its own launch): the kernel reads them
    instead, and no translation runs (rows_first is then taken as True). Needs the indices they come from.
    """
    B, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert q_pe.shape[:2] == (B, H) and kv_pool.shape[-1] == R + P, "q_lat/q_pe/kv_pool shapes disagree"
    assert page_table.shape[0] == B and lens.shape == (B,), "page_table/lens need one row per sequence"
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and kv_pool.stride(-1) == 1, "unit last stride"
    if out is None:
        out = torch.empty(B, H, R, dtype=out_dtype or q_lat.dtype, device=q_lat.device)
    assert out.shape == (B, H, R) and out.stride(-1) == 1
    if indices is not None:
        assert indices.shape[0] == B and indices.stride(-1) == 1
        num_positions = indices.shape[1]
    else:
        num_positions = page_table.shape[1] * page_size
    if rows is not None:
        if indices is None:
            raise ValueError("sparse_mla_decode: rows need the indices they were translated from")
        if (
            rows.shape != indices.shape
            or rows.dtype != torch.int32
            or (rows.shape[1] > 1 and rows.stride(1) != 1)
            or rows.device != indices.device
        ):
            raise ValueError(
                f"sparse_mla_decode: rows must be {tuple(indices.shape)} int32 on {indices.device} with unit column "
                f"stride (selected_rows' layout), got {tuple(rows.shape)} {rows.dtype} on {rows.device}, strides "
                f"{rows.stride()}"
            )
        rows_first = True
    if B == 0 or H == 0:
        return out
    if B > max_rows:
        for a in range(0, B, max_rows):
            b = min(a + max_rows, B)
            part = None if indices is None else indices[a:b]
            sparse_mla_decode(
                q_lat[a:b], q_pe[a:b], kv_pool, page_table[a:b], page_size, lens[a:b], part, scale,
                out=out[a:b], num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                valid_first=valid_first, rows_first=rows_first, rows=None if rows is None else rows[a:b],
            )  # fmt: skip
        return out

    block_h = head_block(H)
    warps = num_warps or (4 if block_h == 16 else 8)
    sms, smem = _device_limits(kv_pool.device)
    if num_splits is None:
        num_splits = choose_num_splits(B, H, num_positions, sms)
    rows_first = rows_first and indices is not None
    tile_n, stages = choose_tile(num_splits, block_h, (R + P) * kv_pool.element_size(), rows_first, smem)
    block_n, num_stages = block_n or tile_n, num_stages or stages
    num_splits = max(1, min(num_splits, triton.cdiv(max(num_positions, 1), block_n)))
    chunk = triton.cdiv(triton.cdiv(max(num_positions, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(num_positions, 1), chunk)  # rounding the chunk up can leave fewer
    split = num_splits > 1
    if split:
        part, lse = _partials(B, num_splits, H, R, q_lat.device)
        dest, (o_b, o_s, o_h) = part, part.stride()[:3]
        lse_b, lse_s = lse.stride(0), lse.stride(1)
    else:
        dest, (o_b, o_h), o_s = out, out.stride()[:2], 0
        lse, lse_b, lse_s = out, 0, 0  # unused
    if rows_first:
        indices = rows if rows is not None else selected_rows(indices, page_table, page_size, lens)
    idx = indices if indices is not None else lens  # a placeholder pointer when dense
    block_r = max(16, triton.next_power_of_2(R))
    # The CPU interpreter (triton 3.9) returns garbage for a bf16 tl.dot (a 16x16 case is off by 1e10): upcast.
    dot_f32 = kv_pool.dtype == torch.float32 or not kv_pool.is_cuda
    precision = "ieee" if dot_f32 else "tf32"  # exact fp32 products; ignored for 16-bit operands

    grid = (triton.cdiv(H, block_h), B, num_splits)
    _decode_kernel[grid](
        q_lat,
        q_pe,
        kv_pool,
        page_table,
        lens,
        idx,
        dest,
        lse,
        H,
        R,
        P,
        num_positions,
        chunk,
        page_size,
        scale * math.log2(math.e),
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_pool.stride(0),
        page_table.stride(0),
        idx.stride(0),
        o_b,
        o_s,
        o_h,
        lse_b,
        lse_s,
        HAS_INDICES=indices is not None,
        ROWS=rows_first,
        VALID_FIRST=valid_first,
        SPLIT=split,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(P)),
        DOT_F32=dot_f32,
        DOT_PRECISION=precision,
        num_warps=warps,
        num_stages=num_stages,
        **pdl_args(q_lat),
    )
    if split:
        _combine_kernel[(H, B)](
            part,
            lse,
            out,
            R,
            num_splits,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_R=block_r,
            num_warps=4,
            **pdl_args(out),
        )
    return out


def mla_decode_paged(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pool: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    valid_first: bool = False,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mla_decode_batched` over the paged pool instead of a padded gather: absorb (bmm), latent attention
    (`sparse_mla_decode`), W_UV (bmm). q_nope [B, H, Dn], q_pe [B, H, P], kv_pool [rows, R + P],
    page_table [B, maxp], lens [B], w_uk [H, Dn, R], w_uv [H, Dv, R], indices [B, k] or None (dense), rows
    [B, k] int32: the indices' pool rows already made (`sparse_mla_decode`'s rows), or None.
    Returns o [B, H, Dv] in q_nope.dtype (16-bit inputs give 16-bit q_lat and o_lat, fp32 inside each op)."""
    return absorbed(
        q_nope,
        w_uk,
        w_uv,
        lambda q_lat, out: sparse_mla_decode(
            q_lat,
            q_pe,
            kv_pool,
            page_table,
            page_size,
            lens,
            indices,
            scale,
            out=out,
            num_splits=num_splits,
            valid_first=valid_first,
            rows=rows,
        ),  # fmt: skip
    )


def absorbed(q_nope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, latent_attention) -> torch.Tensor:
    """MLA in absorbed form around a latent-space kernel: q_lat = W_UK^T q_nope (bmm), then
    latent_attention(q_lat [B, H, R], out [B, H, R]) fills o_lat, then o = W_UV o_lat (bmm).
    q_nope [B, H, Dn], w_uk [H, Dn, R], w_uv [H, Dv, R] -> o [B, H, Dv] in q_nope.dtype."""
    B, H, _ = q_nope.shape
    dt = q_nope.dtype
    R = w_uk.shape[-1]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(dt))  # [H, B, R]
    o_lat = torch.empty(H, B, R, dtype=dt, device=q_nope.device)  # [H, B, R]: the layout the next bmm wants
    latent_attention(q_lat.transpose(0, 1), o_lat.transpose(0, 1))  # [B, H, R] views
    o = torch.empty(B, H, w_uv.shape[1], dtype=dt, device=q_nope.device)  # [B, H, Dv]
    # written through its [H, B, Dv] view: no copy into the layout the caller wants after the bmm
    torch.bmm(o_lat, w_uv.to(dt).transpose(1, 2), out=o.transpose(0, 1))
    return o


def decode_bytes(
    batch: int,
    context: int,
    topk: int | None,
    *,
    num_heads: int = 16,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    nope_dim: int = 128,
    v_dim: int = 128,
    page_size: int = 64,
    elem_bytes: int = 2,
    index_bytes: int = 8,
    weights: bool = False,
) -> int:
    """HBM bytes of one decode step of one layer (defaults: `mini`, bf16): selected latent rows, indices,
    page-table entries (an upper bound: one per selected token, at most one per page), q_lat and q_pe read,
    o_lat written; weights=True adds W_UK, W_UV and the bmm activations (q_nope, q_lat, o_lat, o).
    topk None = dense over the whole context."""
    H, R, P = num_heads, kv_lora_rank, rope_dim
    n = context if topk is None else min(context, topk)
    pages = min(n, -(-context // page_size))
    per_seq = n * (R + P) * elem_bytes + pages * index_bytes
    per_seq += 0 if topk is None else topk * index_bytes
    per_seq += (2 * H * R + H * P) * elem_bytes
    total = batch * per_seq
    if weights:
        total += H * (nope_dim + v_dim) * R * elem_bytes  # W_UK, W_UV
        total += batch * H * (nope_dim + 2 * R + v_dim) * elem_bytes  # q_nope, q_lat written, o_lat read, o
    return total
