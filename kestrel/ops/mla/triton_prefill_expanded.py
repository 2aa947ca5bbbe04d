"""Sparse MLA prefill in expanded form, in Triton: the chunk's history is expanded to per-head keys and values once
(W_UK and W_UV on the latent rows, as the dense prefill does), then a FlashAttention-style kernel walks it with
the DSA selection applied as a mask. Same result as `naive.mla_attention_absorbed` with the same indices.

Legend: T query rows (the chunk: positions q0 .. q0 + T - 1 of its sequence), L = q0 + T keys, H heads, R
kv_lora_rank, Dn / P / Dv the nope / rope / value dims, BM queries per program (one head), BN keys per tile.

Why. The absorbed form (the decode kernel, every prefill token a row) multiplies in the R-wide latent space:
2 H (R + P + R) FLOPs per (query, selected key) pair, 35 K at `mini` (R 512, P 64, 16 heads), as [H, R] x [R, BN]
dots with an M of 16 heads, each query gathering its own k rows (2.36 MB at k = 2048). Expanded, a pair costs
2 H (Dn + P + Dv) = 10 K FLOPs (3.4x fewer), and BM queries of one head share each key tile: M = BM on the
tensor cores. The price: the kernel walks every key tile up to its block's last query and masks what a query did
not select (a block whose queries all selected their whole past walks its tiles unmasked), so its work grows
with the causal length rather than with k: the layer weighs the two (`use_expanded`). Measured on the H200
(session 9): a branch to skip tiles no query selected, a per-element gather of the mask and a per-word select
each made it slower (the branch stops the loads' pipelining); so did (session 13) an OR of a per-row `full` flag
into the mask, 13% at 32K tokens. Tiles: BLOCK_M below.

The selection arrives as indices [T, k] (-1 unused) and becomes a bitmap ([T, cdiv(L, 32)] int32, bit p % 32 of
word p // 32 set where position p is selected) in one kernel (`selection_bits`); a tile reads BN / 32 words per
query and expands them.
Without indices it is causal attention (the dense ceiling of the same kernel). Softmax online in fp32, base 2;
query blocks run last-first, the longest first, for the causal imbalance.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kestrel.ops.mla.sdpa_prefill import expand_history

# The two kernels' costs on the H200 at mini's sizes (bench/results/2026-11-30-h200-session9.json, call 6): the rows
# kernel 0.65 ns per (query, selected key) pair; this one ~0.031 ns per (query, causal key) pair (the slope between
# the last 4096 queries of 16K and of 32K context: 2.58 and 4.83 ms), plus the expansion of the history, two GEMMs
# (4.2 MFLOP a row) and 8 KiB of keys and values written a row: ~10 ns a row by the matmul and copy ceilings, ~320
# pairs (an estimate, not timed at short chunks). In pairs of this kernel the rows kernel's pair costs ~20.
EXPANDED_PAIR_COST_RATIO = 20
EXPANSION_PAIRS_PER_ROW = 320
# Queries x keys per tile, warps, pipeline stages: session 9's 128 x 128 in 8 warps, 2 stages. Session 13
# (bench/results/2026-11-30-h200-session13.json): scripts/prefill_kernel_sweep.py timed 64 x 64 in 4 warps as fast
# alone (one sequence, the expansion and bitmap included: 20.2 against 19.9 ms at 32K tokens, 0.62 against 0.70
# at 4K; a variant of the kernel with one more mask operation, since dropped), but inside the engine's prefill
# step this kernel in 64 x 64 took 119.6 ms over mini's 6 layers at 1 x 32768 against 101 ms in 128 x 128, and
# 18.4 against 17.1 at 8 x 4096. 3 stages at 128 x 128 or 128 x 64 in 8 warps exceed the 227 KiB of shared memory.
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 128, 8, 2


def use_expanded(q0: int, T: int, k: int) -> bool:
    """Whether this kernel beats the rows kernel for the chunk of T queries at positions q0 .. q0 + T - 1 with a
    top-k of k: its causal (query, key) pairs plus the expansion of the q0 + T history rows against
    EXPANDED_PAIR_COST_RATIO x the selected pairs."""
    causal = T * q0 + T * (T + 1) // 2 + EXPANSION_PAIRS_PER_ROW * (q0 + T)
    a, b = q0 + 1, min(q0 + T, k)  # the rows that select their whole past: p + 1 from a to b
    whole = max(0, b - a + 1)
    selected = whole * (a + b) // 2 + (T - whole) * k
    return causal <= EXPANDED_PAIR_COST_RATIO * selected


@triton.jit
def _tile(q, q_pe, m_i, l_i, acc, vis, n, end, h, k_ptr, kpe_ptr, v_ptr, qk_scale, Dn, P, Dv,
          stride_kl, stride_kh, stride_kpl, stride_vl, stride_vh,
          DOT_PRECISION: tl.constexpr, BDN: tl.constexpr, BP: tl.constexpr, BDV: tl.constexpr):  # fmt: skip
    """One key tile n [BN] of the online softmax: the running (max, sum, output) of the block's queries."""
    dn, dp, dv = tl.arange(0, BDN), tl.arange(0, BP), tl.arange(0, BDV)
    n64 = n.to(tl.int64)
    n_ok = (n < end)[:, None]
    k = tl.load(
        k_ptr + n64[:, None] * stride_kl + h * stride_kh + dn[None, :],
        mask=n_ok & (dn < Dn)[None, :],
        other=0.0,
    )  # [BN, BDN]
    k_pe = tl.load(
        kpe_ptr + n64[:, None] * stride_kpl + dp[None, :], mask=n_ok & (dp < P)[None, :], other=0.0
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN]
    s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION)
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])  # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + n64[:, None] * stride_vl + h * stride_vh + dv[None, :],
        mask=n_ok & (dv < Dv)[None, :],
        other=0.0,
    )  # [BN, BDV]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _walk(q, q_pe, t, t_ok, q_pos, h, k_ptr, kpe_ptr, v_ptr, bits_ptr, words, end, qk_scale, Dn, P, Dv,
          stride_kl, stride_kh, stride_kpl, stride_vl, stride_vh,
          MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BDN: tl.constexpr, BP: tl.constexpr, BDV: tl.constexpr):  # fmt: skip
    """The block's key tiles up to `end`: causal, and with MASKED the selection bitmap too. The kernel picks the
    form once per query block, so that the loop carries no branch (one inside it stops the loads' pipelining)."""
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    t64 = t.to(tl.int64)
    for n0 in range(0, end, BN):
        n = n0 + tl.arange(0, BN)  # [BN]
        vis = (n[None, :] <= q_pos[:, None]) & t_ok[:, None]  # [BM, BN] causal
        if MASKED:
            # the tile's BN / 32 bitmap words of each query, expanded to bits
            w = n0 // 32 + tl.arange(0, BN // 32)  # [BN / 32] the tile's bitmap words
            word = tl.load(
                bits_ptr + t64[:, None] * words + w[None, :],
                mask=t_ok[:, None] & (w < words)[None, :],
                other=0,
            )  # [BM, BN / 32]
            bit = (word[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1  # [BM, BN / 32, 32]
            vis = vis & (tl.reshape(bit, [BM, BN]) != 0)
        m_i, l_i, acc = _tile(q, q_pe, m_i, l_i, acc, vis, n, end, h, k_ptr, kpe_ptr, v_ptr, qk_scale,
                              Dn, P, Dv, stride_kl, stride_kh, stride_kpl, stride_vl, stride_vh,
                              DOT_PRECISION, BDN, BP, BDV)  # fmt: skip
    return l_i, acc


@triton.jit
def _expanded_prefill_kernel(
    q_ptr,  # [T, H, Dn]
    qpe_ptr,  # [T, H, P]
    k_ptr,  # [L, H, Dn]
    kpe_ptr,  # [L, P] one rope key per position, shared by the heads
    v_ptr,  # [L, H, Dv]
    bits_ptr,  # [T, words] int32 (unused without SELECT)
    full_ptr,  # [T] int8: 1 where the query selected every position up to its own (unused without SELECT)
    out_ptr,  # [T, H, Dv]
    T,
    q0,
    words,
    qk_scale,  # scale * log2(e)
    Dn,
    P,
    Dv,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_kl,
    stride_kh,
    stride_kpl,
    stride_vl,
    stride_vh,
    stride_ot,
    stride_oh,
    SELECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BDN: tl.constexpr,
    BP: tl.constexpr,
    BDV: tl.constexpr,
):
    qb = tl.num_programs(0) - 1 - tl.program_id(0)  # the last (longest) query blocks first
    h = tl.program_id(1).to(tl.int64)
    t = qb * BM + tl.arange(0, BM)  # [BM]
    t_ok = t < T
    q_pos = q0 + t
    dn, dp, dv = tl.arange(0, BDN), tl.arange(0, BP), tl.arange(0, BDV)
    t64 = t.to(tl.int64)
    q = tl.load(
        q_ptr + t64[:, None] * stride_qt + h * stride_qh + dn[None, :],
        mask=t_ok[:, None] & (dn < Dn)[None, :],
        other=0.0,
    )  # [BM, BDN]
    q_pe = tl.load(
        qpe_ptr + t64[:, None] * stride_pt + h * stride_ph + dp[None, :],
        mask=t_ok[:, None] & (dp < P)[None, :],
        other=0.0,
    )  # [BM, BP]
    end = q0 + tl.minimum(T, (qb + 1) * BM)  # no key past the block's last query is visible
    masked = False
    if SELECT:  # a block whose queries all selected their whole causal past needs no bitmap (short contexts)
        masked = tl.min(tl.load(full_ptr + t, mask=t_ok, other=1).to(tl.int32)) == 0
    if masked:
        l_i, acc = _walk(q, q_pe, t, t_ok, q_pos, h, k_ptr, kpe_ptr, v_ptr, bits_ptr, words, end, qk_scale,
                         Dn, P, Dv, stride_kl, stride_kh, stride_kpl, stride_vl, stride_vh,
                         True, DOT_PRECISION, BM, BN, BDN, BP, BDV)  # fmt: skip
    else:
        l_i, acc = _walk(q, q_pe, t, t_ok, q_pos, h, k_ptr, kpe_ptr, v_ptr, bits_ptr, words, end, qk_scale,
                         Dn, P, Dv, stride_kl, stride_kh, stride_kpl, stride_vl, stride_vh,
                         False, DOT_PRECISION, BM, BN, BDN, BP, BDV)  # fmt: skip
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # zeros for a row that selected nothing
    out = out_ptr + t64[:, None] * stride_ot + h * stride_oh + dv[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & (dv < Dv)[None, :])


@triton.jit
def _bitmap_kernel(idx_ptr, bits_ptr, full_ptr, k, q0, words, stride_it, BK: tl.constexpr,
                   DISTINCT: tl.constexpr):  # fmt: skip
    """Row t of indices [T, k] -> its bitmap row (zeroed before) and whether it selected its whole causal past.
    Entries < 0 or past the query's own position are left out (the attention masks those causally anyway).
    With DISTINCT entries a row of at most k positions is counted first: when it selected them all (every query
    before position k in a prefill), its bits are whole words of ones, stored without the per-entry atomics.
    Without it (a replayed selection may repeat an entry, and a count would then overstate it) every row takes
    the atomics and none is marked full."""
    t = tl.program_id(0)
    pos = q0 + t
    row = idx_ptr + t.to(tl.int64) * stride_it
    bits = bits_ptr + t.to(tl.int64) * words
    total = tl.zeros([], tl.int32)
    if DISTINCT:
        if pos < k:
            for k0 in range(0, k, BK):
                j = k0 + tl.arange(0, BK)
                idx = tl.load(row + j, mask=j < k, other=-1)  # [BK] int64
                total += tl.sum(((idx >= 0) & (idx <= pos)).to(tl.int32), 0)
    if total == pos + 1:  # positions 0 .. pos: words of ones, the last one up to bit pos % 32
        last = pos // 32
        for w0 in range(0, last + 1, BK):
            w = w0 + tl.arange(0, BK)
            partial = (tl.full([BK], 2, tl.int64) << (pos % 32)) - 1  # bits 0 .. pos % 32 (31: int32's sign)
            ones = tl.where(w < last, -1, partial)
            tl.store(bits + w, ones.to(tl.int32), mask=w <= last)
    else:
        for k0 in range(0, k, BK):
            j = k0 + tl.arange(0, BK)
            idx = tl.load(row + j, mask=j < k, other=-1)  # [BK] int64
            ok = (idx >= 0) & (idx <= pos)
            word = tl.where(ok, idx // 32, 0)
            one = tl.full([BK], 1, tl.int64)
            bit = tl.where(ok, one << (idx % 32), 0).to(tl.int32)  # bit 31 becomes int32's sign bit
            tl.atomic_or(bits + word, bit, mask=ok, sem="relaxed")
    tl.store(full_ptr + t, (total == pos + 1).to(tl.int8))


def selection_bits(
    indices: torch.Tensor, q0: int, length: int, distinct: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of T queries at positions q0 .. q0 + T - 1 (indices [T, k], -1 unused) as a bitmap of each
    query's selected causal past ([T, cdiv(length, 32)] int32, bit p % 32 of word p // 32), and full [T] int8:
    1 where a query selected every position up to its own. `distinct`: each row's entries are distinct, as the
    top-k gives them (counting them then tells a full row); a replayed selection promises nothing: pass False,
    and no row is marked full. One kernel, one program per row (the torch form took ~10 passes over int64
    [T, k] temporaries)."""
    T, k = indices.shape
    bits = torch.zeros(T, max(1, triton.cdiv(length, 32)), dtype=torch.int32, device=indices.device)
    full = torch.empty(T, dtype=torch.int8, device=indices.device)
    if T:
        indices = (
            indices
            if indices.dtype == torch.int64 and indices.stride(-1) == 1
            else indices.long().contiguous()
        )
        BK = min(2048, triton.next_power_of_2(max(k, 16)))
        _bitmap_kernel[(T,)](
            indices,
            bits,
            full,
            k,
            q0,
            bits.shape[1],
            indices.stride(0),
            BK=BK,
            DISTINCT=distinct,
            num_warps=4,
        )
    return bits, full


def sparse_mla_prefill_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
    *,
    distinct: bool = True,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
) -> torch.Tensor:
    """o [T, H, Dv] (q_nope.dtype) of a prefill chunk: q_nope [T, H, Dn], q_pe [T, H, P], the last T of the
    sequence's latent rows kv [L, R + P] (gathered from the pool), w_uk [H, Dn, R], w_uv [H, Dv, R], indices
    [T, k] each query's selected positions (-1 unused; positions past the query's own are ignored) or None for
    causal attention over every position; `distinct`: no row repeats an entry (the top-k's; False for a replayed
    selection: `selection_bits`). block_m queries of one head per program, block_n keys per tile."""
    T, H, Dn = q_nope.shape
    L, P, Dv = kv.shape[0], q_pe.shape[-1], w_uv.shape[1]
    assert T <= L, f"{T} queries over {L} rows: the chunk's own rows must be in kv"
    assert q_pe.shape[:2] == (T, H) and w_uk.shape[:2] == (H, Dn) and kv.shape[1] == w_uk.shape[2] + P
    assert block_n >= 32 and block_n & (block_n - 1) == 0, (
        f"block_n={block_n}: a power of 2 >= 32 (a bitmap word)"
    )
    assert block_m >= 16 and block_m & (block_m - 1) == 0, (
        f"block_m={block_m}: a power of 2 >= 16 (the dot's M)"
    )
    dt = q_nope.dtype
    out = torch.empty(T, H, Dv, dtype=dt, device=q_nope.device)
    if T == 0:
        return out
    if not q_nope.is_cuda:  # Triton's interpreter (numpy) has no bf16 dot: it runs in fp32
        dt = torch.float32
    k, k_pe, v = expand_history(kv, w_uk, w_uv, dt)
    q_nope, q_pe = (
        x if x.dtype == dt and x.stride(-1) == 1 else x.to(dt).contiguous() for x in (q_nope, q_pe)
    )
    if indices is not None:
        bits, full = selection_bits(indices, L - T, L, distinct)  # [T, words], [T]
    else:  # placeholders of the right types (never read: the kernel still compiles the masked walk)
        bits = torch.zeros(1, 1, dtype=torch.int32, device=out.device)
        full = torch.ones(1, dtype=torch.int8, device=out.device)
    grid = (triton.cdiv(T, block_m), H)
    _expanded_prefill_kernel[grid](
        q_nope, q_pe, k, k_pe, v, bits, full, out,
        T, L - T, bits.shape[1] if indices is not None else 0, scale * math.log2(math.e), Dn, P, Dv,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k.stride(0), k.stride(1), k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        SELECT=indices is not None,
        DOT_PRECISION="ieee" if dt == torch.float32 else "tf32", BM=block_m, BN=block_n,
        BDN=max(16, triton.next_power_of_2(Dn)), BP=max(16, triton.next_power_of_2(P)),
        BDV=max(16, triton.next_power_of_2(Dv)),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
