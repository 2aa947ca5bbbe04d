"""Sparse MLA prefill for short contexts in Triton: blocks of queries share each key tile, the selection applied
as a mask. Same result as the decode kernel run with every prefill token a row (`sparse_mla_decode`).

Legend: T query rows (the new tokens of one sequence, positions q0 .. q0 + T - 1), H heads, R kv_lora_rank,
P rope dims, k selected positions per row, L the sequence's cached length, BQ queries per program, BN key
positions per tile, RC the slice of R a program writes.

Why. At `mini`'s 16 heads the decode kernel's dot for one query is [16, R] x [R, BN]: an M of 16 on the tensor
cores, and every query gathers its own k rows (2.36 MB at k = 2048), mostly from L2. In a short context the
selections of neighbouring queries overlap (each holds k of at most 2k positions), so here BQ queries of the
same sequence walk the sequence's positions once, tile by tile ([BN, R + P] read once for BQ x H rows of the
dot, M = 64 at BQ = 4), and each (query, position) pair outside the query's selection is masked to -inf. Tiles
that no query of the block selected are skipped. The work per query is then its causal length rather than k,
so this pays only while the context is at most a small multiple of k; the layer uses it below
`MASKED_MAX_CONTEXT_OVER_TOPK` x k.

The selection arrives as indices [T, k] (-1 unused) and becomes a bitmap [T, cdiv(L, 32)] int32 (bit p % 32 of
word p // 32 set where position p is selected), built with one scatter. Softmax is online in fp32 (base 2);
each program computes the full scores (R + P) and accumulates its RC columns of the output, so SPLIT_R = R / RC
programs share a query block (RC = R / 2 by default: a [64, 256] fp32 accumulator in 8 warps).
Not yet run on the GPU: KESTREL_SPARSE_PREFILL=masked opts in, `kestrel bench kernels` times it beside the
decode kernel, and `gpu_suite.py --sections prefill_bench` runs the 8 x 4096 step both ways.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kestrel.ops.mla.triton_decode import absorbed

MASKED_MAX_CONTEXT_OVER_TOPK = 2  # the layer uses this kernel where the context is at most this many x k
MASKED_MAX_HEADS = (
    32  # and where the heads fit: at 64, even one query's tiles outgrow shared memory at R = 512
)


def selection_bitmap(indices: torch.Tensor, length: int) -> torch.Tensor:
    """indices [T, k] positions (entries < 0 or >= length unused; the others distinct within a row, as the
    top-k gives them and as the decode kernel also requires) -> bitmap [T, cdiv(length, 32)] int32 with bit
    p % 32 of word p // 32 set for each selected p."""
    T, _ = indices.shape
    words = max(1, triton.cdiv(length, 32))
    indices = indices.long()
    bits = torch.zeros(T, words, dtype=torch.int32, device=indices.device)
    valid = (indices >= 0) & (indices < length)
    pos = indices.clamp(0, max(length - 1, 0))  # unused entries add 0 to word 0 below
    val = torch.where(valid, torch.bitwise_left_shift(torch.ones_like(pos), pos % 32), 0).to(torch.int32)
    # distinct positions: each bit is added once, so the sum is the OR (bit 31 wraps to int32's sign bit)
    return bits.scatter_add_(1, pos // 32, val)


@triton.jit
def _masked_prefill_kernel(
    q_lat_ptr,
    q_pe_ptr,
    kv_ptr,
    pages_ptr,
    bits_ptr,
    out_ptr,
    T,
    H,
    R,
    P,
    q0,
    page_size,
    words,
    qk_scale,  # scale * log2(e)
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_kv,
    stride_ot,
    stride_oh,
    BQ: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    BR: tl.constexpr,
    RC: tl.constexpr,
    BP: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    rc = tl.program_id(1)  # which RC columns of the output this program writes
    m = tl.arange(0, BQ * BH)  # [M] rows of the dot: query qb * BQ + m // BH, head m % BH
    q_idx = qb * BQ + m // BH
    head = m % BH
    row_ok = (q_idx < T) & (head < H)
    offs_r, offs_c, offs_p = tl.arange(0, BR), rc * RC + tl.arange(0, RC), tl.arange(0, BP)
    r_ok, c_ok, p_ok = offs_r < R, offs_c < R, offs_p < P
    if DOT_F32:
        dot_dtype = tl.float32
    else:
        dot_dtype = kv_ptr.dtype.element_ty
    q_row = q_idx.to(tl.int64)
    head = head.to(tl.int64)
    q_lat = tl.load(
        q_lat_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_r[None, :],
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    ).to(dot_dtype)  # [M, BR]
    q_pe = tl.load(
        q_pe_ptr + q_row[:, None] * stride_pt + head[:, None] * stride_ph + offs_p[None, :],
        mask=row_ok[:, None] & p_ok[None, :],
        other=0.0,
    ).to(dot_dtype)  # [M, BP]

    m_i = tl.full([BQ * BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * BH], tl.float32)
    acc = tl.zeros([BQ * BH, RC], tl.float32)
    # the block's last query sits at q0 + min(T, (qb + 1) * BQ) - 1: no position past it is selected
    end = q0 + tl.minimum(T, (qb + 1) * BQ)
    for n0 in range(0, end, BN):
        pos = n0 + tl.arange(0, BN)  # [BN]
        in_range = pos < end
        word = tl.load(
            bits_ptr + q_row[:, None] * words + (pos // 32)[None, :],
            mask=row_ok[:, None] & in_range[None, :],
            other=0,
        )  # [M, BN] the bitmap word holding each (row's query, position)
        sel = ((word >> (pos % 32)[None, :]) & 1) != 0  # [M, BN]
        sel = sel & (pos[None, :] <= (q0 + q_idx)[:, None])  # causal, whatever the selection holds
        if tl.max(sel.to(tl.int32)) > 0:  # a tile no query of the block selected is skipped
            page = tl.load(pages_ptr + pos // page_size, mask=in_range, other=0)
            kv_row = page.to(tl.int64) * page_size + pos % page_size  # [BN]
            base = kv_ptr + kv_row[:, None] * stride_kv
            c_kv = tl.load(base + offs_r[None, :], mask=in_range[:, None] & r_ok[None, :], other=0.0)
            k_pe = tl.load(base + R + offs_p[None, :], mask=in_range[:, None] & p_ok[None, :], other=0.0)
            qk = tl.dot(q_lat, tl.trans(c_kv.to(dot_dtype)), input_precision=DOT_PRECISION)  # [M, BN]
            qk = tl.dot(q_pe, tl.trans(k_pe.to(dot_dtype)), acc=qk, input_precision=DOT_PRECISION)
            qk = tl.where(sel, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(qk - m_shift[:, None])  # [M, BN]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(base + offs_c[None, :], mask=in_range[:, None] & c_ok[None, :], other=0.0)  # [BN, RC]
            acc = acc * alpha[:, None] + tl.dot(
                p.to(dot_dtype), v.to(dot_dtype), input_precision=DOT_PRECISION
            )
            m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # zeros for a row that selected nothing
    out = out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_c[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


def sparse_mla_prefill_masked(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    q0: int,
    indices: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_q: int = 2,
    block_n: int = 32,
    split_r: int = 1,
    num_warps: int = 8,
    num_stages: int = 2,
) -> torch.Tensor:
    """o_lat [T, H, R] of T consecutive query rows of one sequence (positions q0 .. q0 + T - 1) over their
    selections: q_lat [T, H, R] (absorbed, unit last stride), q_pe [T, H, P], kv_pool [rows, R + P], pages [n]
    the sequence's page ids (covering positions 0 .. q0 + T - 1), indices [T, k] positions (-1 unused; each
    row's distinct, <= its own position). Equals `sparse_mla_decode` over the same rows. block_q queries per
    program, block_n positions per tile, split_r programs per query block (each writes R / split_r columns).
    Defaults: M = 32 rows of the dot at 16 heads, which compiles for sm_90 (Triton 3.6) in 236 registers without
    spills; block_q 4 with split_r 2 spilled 472 bytes (offline compile; the bench times both)."""
    T, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert q_pe.shape[:2] == (T, H) and kv_pool.shape[-1] == R + P and indices.shape[0] == T
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and kv_pool.stride(-1) == 1
    RC = R // split_r
    assert R % split_r == 0 and RC >= 16 and RC & (RC - 1) == 0, (
        f"R={R} / split_r={split_r}: a power of 2 >= 16"
    )
    assert block_n >= 16 and block_n & (block_n - 1) == 0, (
        f"block_n={block_n}: a power of 2 >= 16 (the K of the probabilities-by-values dot)"
    )
    BH = triton.next_power_of_2(H)
    # tl.dot needs M = block_q * BH >= 16; past M = 64 the tiles outgrow shared memory (64 heads at block_q 4:
    # 331 KB against the H200's 227 KB)
    block_q = max(triton.cdiv(16, BH), min(block_q, max(1, 64 // BH)))
    if out is None:
        out = torch.empty(T, H, R, dtype=q_lat.dtype, device=q_lat.device)
    assert out.shape == (T, H, R) and out.stride(-1) == 1
    if T == 0:
        return out
    length = q0 + T
    bits = selection_bitmap(indices, length)  # [T, words]
    pages = pages.contiguous()
    dot_f32 = kv_pool.dtype == torch.float32 or not kv_pool.is_cuda  # the interpreter's bf16 dot: fp32
    grid = (triton.cdiv(T, block_q), split_r)
    _masked_prefill_kernel[grid](
        q_lat, q_pe, kv_pool, pages, bits, out,
        T, H, R, P, q0, page_size, bits.shape[1], scale * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_pool.stride(0),
        out.stride(0), out.stride(1),
        BQ=block_q, BH=BH, BN=block_n, BR=max(16, triton.next_power_of_2(R)), RC=RC,
        BP=max(16, triton.next_power_of_2(P)),
        DOT_F32=dot_f32, DOT_PRECISION="ieee" if dot_f32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def mla_prefill_masked_paged(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    q0: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    indices: torch.Tensor,
) -> torch.Tensor:
    """`mla_decode_paged` for T consecutive prefill rows of one sequence (positions q0 .. q0 + T - 1) through
    the masked kernel: q_nope [T, H, Dn], q_pe [T, H, P], pages [n] the sequence's pages, indices [T, k].
    Returns o [T, H, Dv] in q_nope.dtype."""
    return absorbed(
        q_nope,
        w_uk,
        w_uv,
        lambda q_lat, out: sparse_mla_prefill_masked(
            q_lat, q_pe, kv_pool, pages, page_size, q0, indices, scale, out=out
        ),
    )
