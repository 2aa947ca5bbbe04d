"""MLA references: absorbed == expanded, expanded == plain per-head attention, sparse == dense at full cover.

Legend: T queries, L cached tokens, H heads, R kv_lora_rank, P rope dims (never rotated), Dn nope, Dv v dims.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.dsa import selection_mask, topk_select
from kestrel.ops.mla import mla_attention_absorbed, mla_attention_expanded, split_kv_b

H, R, P, DN, DV = 4, 32, 8, 16, 12
SCALE = (DN + P) ** -0.5

# (L, q_pos): a prefill chunk in the middle of a sequence, a chunk from position 0, single-token decode,
# and scattered positions (speculative verification or any out-of-order batch).
CASES = {
    "chunk_middle": (37, list(range(25, 34))),
    "chunk_start": (11, list(range(11))),
    "decode": (29, [28]),
    "decode_first": (1, [0]),
    "scattered": (40, [3, 17, 18, 39, 0, 22]),
}


def make_inputs(L, q_pos, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = len(q_pos)
    q_nope = torch.randn(T, H, DN, generator=g, dtype=dtype)  # [T, H, Dn]
    q_pe = torch.randn(T, H, P, generator=g, dtype=dtype)  # [T, H, P]
    kv_cache = torch.randn(L, R + P, generator=g, dtype=dtype)  # [L, R + P]
    kv_b = torch.randn(H * (DN + DV), R, generator=g, dtype=dtype) * R**-0.5  # [H * (Dn + Dv), R]
    return q_nope, q_pe, kv_cache, kv_b, torch.tensor(q_pos, dtype=torch.int64)


def random_selection(L, q_pos, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(q_pos), L, generator=g)  # [T, L]
    return topk_select(scores, q_pos, k)  # [T, k]


def plain_attention(q_nope, q_pe, kv_cache, kv_b, q_pos, scale, visible):
    """Per (query, head) softmax attention over explicitly expanded keys and values."""
    T, L = q_nope.shape[0], kv_cache.shape[0]
    c_kv, k_pe = kv_cache[:, :R], kv_cache[:, R:]
    w = kv_b.view(H, DN + DV, R)
    out = torch.zeros(T, H, DV, dtype=q_nope.dtype)
    for h in range(H):
        k_nope = c_kv @ w[h, :DN].T  # [L, Dn]
        v = c_kv @ w[h, DN:].T  # [L, Dv]
        k = torch.cat([k_nope, k_pe], dim=-1)  # [L, Dn + P]
        for t in range(T):
            rows = [s for s in range(L) if s <= q_pos[t] and visible[t, s]]
            q = torch.cat([q_nope[t, h], q_pe[t, h]])  # [Dn + P]
            logits = k[rows] @ q * scale  # [n]
            out[t, h] = torch.softmax(logits, dim=0) @ v[rows]
    return out


def test_split_kv_b():
    w = torch.arange(H * (DN + DV) * R, dtype=torch.float32).view(H * (DN + DV), R)
    w_uk, w_uv = split_kv_b(w, H, DN, DV)
    assert w_uk.shape == (H, DN, R) and w_uv.shape == (H, DV, R)
    for h in range(H):
        base = h * (DN + DV)
        assert torch.equal(w_uk[h], w[base : base + DN])
        assert torch.equal(w_uv[h], w[base + DN : base + DN + DV])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sparse", [False, True])
def test_absorbed_equals_expanded(case, sparse):
    L, q_pos = CASES[case]
    q_nope, q_pe, kv_cache, kv_b, pos = make_inputs(L, q_pos)
    indices = random_selection(L, pos, k=5) if sparse else None
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    o_exp = mla_attention_expanded(q_nope, q_pe, kv_cache, kv_b, pos, SCALE, DV, indices)
    o_abs = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE, indices)
    assert o_exp.dtype == torch.float64 and o_exp.shape == (len(q_pos), H, DV)
    torch.testing.assert_close(o_abs, o_exp, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sparse", [False, True])
def test_expanded_equals_plain_attention(case, sparse):
    L, q_pos = CASES[case]
    q_nope, q_pe, kv_cache, kv_b, pos = make_inputs(L, q_pos, seed=2)
    indices = random_selection(L, pos, k=6, seed=3) if sparse else None
    visible = selection_mask(indices, L) if sparse else torch.ones(len(q_pos), L, dtype=torch.bool)
    ref = plain_attention(q_nope, q_pe, kv_cache, kv_b, q_pos, SCALE, visible)
    out = mla_attention_expanded(q_nope, q_pe, kv_cache, kv_b, pos, SCALE, DV, indices)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_full_cover_sparse_equals_dense(case):
    L, q_pos = CASES[case]
    q_nope, q_pe, kv_cache, kv_b, pos = make_inputs(L, q_pos, seed=4)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    # Every visible row, once via topk_select with k >= L and once hand-shuffled with padding in between.
    by_topk = random_selection(L, pos, k=L + 3, seed=5)
    g = torch.Generator().manual_seed(6)
    by_hand = torch.full((len(q_pos), L + 2), -1, dtype=torch.int64)
    for t, p in enumerate(q_pos):
        slots = torch.randperm(L + 2, generator=g)[: p + 1]
        by_hand[t, slots] = torch.randperm(p + 1, generator=g)
    dense_exp = mla_attention_expanded(q_nope, q_pe, kv_cache, kv_b, pos, SCALE, DV)
    dense_abs = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE)
    for idx in (by_topk, by_hand):
        sparse_exp = mla_attention_expanded(q_nope, q_pe, kv_cache, kv_b, pos, SCALE, DV, idx)
        sparse_abs = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE, idx)
        assert torch.equal(sparse_exp, dense_exp) and torch.equal(sparse_abs, dense_abs)


def test_selection_past_q_pos_is_hidden():
    L, q_pos = CASES["chunk_middle"]
    q_nope, q_pe, kv_cache, kv_b, pos = make_inputs(L, q_pos, seed=7)
    causal = random_selection(L, pos, k=4, seed=8)  # [T, 4]
    assert (pos < L - 1).all()
    future = torch.full((len(q_pos), 2), L - 1, dtype=torch.int64)  # last row, twice: every query's future
    with_future = torch.cat([causal, future], dim=1)  # [T, 6]
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    a = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE, causal)
    b = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE, with_future)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs(dtype):
    L, q_pos = CASES["chunk_middle"]
    inputs64 = make_inputs(L, q_pos, seed=9)
    q_nope, q_pe, kv_cache, kv_b = (x.to(dtype) for x in inputs64[:4])
    pos = inputs64[4]
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    ref = mla_attention_expanded(*(x.double() for x in (q_nope, q_pe, kv_cache, kv_b)), pos, SCALE, DV)
    o_exp = mla_attention_expanded(q_nope, q_pe, kv_cache, kv_b, pos, SCALE, DV)
    o_abs = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE)
    # fp32 inside: only the final cast to bf16 rounds, so both forms sit within bf16 resolution of fp64.
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for o in (o_exp, o_abs):
        assert o.dtype == dtype
        torch.testing.assert_close(o.double(), ref, rtol=tol, atol=tol)
