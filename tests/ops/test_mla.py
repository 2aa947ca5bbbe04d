"""MLA references: absorbed == expanded, expanded == plain per-head attention, sparse == dense at full cover.

Legend: T queries, L cached tokens, H heads, R kv_lora_rank, P rope dims (never rotated), Dn nope, Dv v dims.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.dsa import selection_mask, topk_select
from kestrel.ops.mla import mla_attention_absorbed, mla_attention_expanded, mla_decode_batched, split_kv_b
from tests.ops.graph_check import assert_replay_matches_eager

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


# ---------------------------------------------------------------- batched decode (one query per sequence)

LMAX = 13
LENS = [1, 7, LMAX, 4, 1, 10, LMAX, 2]  # 1 and Lmax included


def make_batched(lens, dtype=torch.float64, seed=10, device="cpu"):
    """Decode inputs for B = len(lens) sequences; cache rows at positions >= lens[b] are NaN."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q_nope = torch.randn(B, H, DN, generator=g, dtype=torch.float64)  # [B, H, Dn]
    q_pe = torch.randn(B, H, P, generator=g, dtype=torch.float64)  # [B, H, P]
    kv = torch.randn(B, LMAX, R + P, generator=g, dtype=torch.float64)  # [B, Lmax, R + P]
    kv_b = torch.randn(H * (DN + DV), R, generator=g, dtype=torch.float64) * R**-0.5
    lens = torch.tensor(lens, dtype=torch.int64)
    kv[torch.arange(LMAX)[None, :] >= lens[:, None]] = float("nan")
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    tensors = (q_nope, q_pe, kv, w_uk, w_uv)
    return (*(t.to(device=device, dtype=dtype) for t in tensors), lens.to(device))


def per_row_reference(q_nope, q_pe, kv, lens, w_uk, w_uv, indices=None):
    rows = []
    for b, n in enumerate(lens.tolist()):
        idx = None if indices is None else indices[b : b + 1]
        q_pos = torch.tensor([n - 1], device=kv.device)
        rows.append(
            mla_attention_absorbed(
                q_nope[b : b + 1], q_pe[b : b + 1], kv[b, :n], w_uk, w_uv, q_pos, SCALE, idx
            )
        )
    return torch.cat(rows)  # [B, H, Dv]


def batched_selection(lens, k, seed=11):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(lens), LMAX, generator=g)  # [B, Lmax]; past lens[b] is not selectable
    return topk_select(scores, lens - 1, k)  # [B, k], -1 padded where lens[b] < k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sparse", [False, True])
def test_decode_batched_equals_per_row(sparse, dtype):
    q_nope, q_pe, kv, w_uk, w_uv, lens = make_batched(LENS, dtype)
    indices = batched_selection(lens, k=5) if sparse else None
    out = mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, SCALE, indices)
    ref = per_row_reference(q_nope, q_pe, kv, lens, w_uk, w_uv, indices)
    assert out.shape == (len(LENS), H, DV) and out.dtype == dtype and not out.isnan().any()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_decode_batched_ignores_hidden_selections_and_empty_rows():
    q_nope, q_pe, kv, w_uk, w_uv, lens = make_batched(LENS, seed=12)
    indices = batched_selection(lens, k=4, seed=13)  # [B, 4]
    beyond = torch.stack([lens, torch.full_like(lens, LMAX + 5)], dim=1)  # past the query, past the cache
    a = mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, SCALE, indices)
    b = mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, SCALE, torch.cat([beyond, indices], dim=1))
    assert torch.equal(a, b)
    # A padding row of a captured batch (lens 0) yields zeros and leaves the other rows alone.
    empty = lens.clone()
    empty[2] = 0
    c = mla_decode_batched(q_nope, q_pe, kv, empty, w_uk, w_uv, SCALE, indices)
    assert torch.equal(c[2], torch.zeros_like(c[2]))
    assert torch.equal(torch.cat([c[:2], c[3:]]), torch.cat([a[:2], a[3:]]))


def test_decode_batched_bf16():
    q_nope, q_pe, kv, w_uk, w_uv, lens = make_batched(LENS, torch.bfloat16, seed=14)
    indices = batched_selection(lens, k=5, seed=15)
    out = mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, SCALE, indices)
    ref = per_row_reference(q_nope, q_pe, kv, lens, w_uk, w_uv, indices)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)  # both fp32 inside: at most a rounding flip apart


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_batched_cuda_graph():
    first = make_batched(LENS, torch.bfloat16, seed=16, device="cuda")
    fresh = make_batched(LENS[::-1], torch.bfloat16, seed=17, device="cuda")  # other lens after capture
    q_nope, q_pe, kv, w_uk, w_uv, lens = first
    indices = batched_selection(lens.cpu(), k=5).cuda()
    fresh_indices = batched_selection(fresh[-1].cpu(), k=5, seed=18).cuda()
    out = mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, SCALE, indices)
    ref = per_row_reference(q_nope, q_pe, kv, lens, w_uk, w_uv, indices)
    torch.testing.assert_close(out, ref)

    def step(q_nope, q_pe, kv, lens, indices):
        return mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, SCALE, indices)

    assert_replay_matches_eager(
        step,
        (q_nope, q_pe, kv, lens, indices),
        (fresh[0], fresh[1], fresh[2], fresh[5], fresh_indices),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,T", [(11, 11), (37, 9), (29, 1), (1, 1)])
def test_sdpa_prefill_equals_absorbed(dtype, L, T):
    """The fused-attention prefill (expanded keys and values, the input dtype) against the absorbed reference,
    for a chunk from position 0 and chunks after a cached prefix."""
    from kestrel.ops.mla.sdpa_prefill import mla_prefill_sdpa

    q_pos = list(range(L - T, L))
    q_nope, q_pe, kv_cache, kv_b, pos = make_inputs(L, q_pos, seed=L + T)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    ref = mla_attention_absorbed(q_nope, q_pe, kv_cache, w_uk, w_uv, pos, SCALE)  # fp64
    args = (x.to(dtype) for x in (q_nope, q_pe, kv_cache, w_uk, w_uv))
    got = mla_prefill_sdpa(*args, SCALE)
    assert got.dtype == dtype and got.shape == ref.shape
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("L,T", [(13, 13), (21, 6)], ids=["from-0", "after-prefix"])
def test_sdpa_prefill_batched_equals_one_sequence_at_a_time(L, T):
    """G sequences of one shape in one call ([G, T, H, *] queries over [G, L, R + P] rows): each sequence's
    output as its own call gives it (fp64: the same sums, one GEMM over all rows or one a sequence)."""
    from kestrel.ops.mla.sdpa_prefill import mla_prefill_sdpa

    q_pos = list(range(L - T, L))
    seqs = [make_inputs(L, q_pos, seed=100 + g) for g in range(3)]
    w_uk, w_uv = split_kv_b(seqs[0][3], H, DN, DV)
    q_nope, q_pe, kv = (torch.stack([s_[j] for s_ in seqs]) for j in range(3))
    got = mla_prefill_sdpa(q_nope, q_pe, kv, w_uk, w_uv, SCALE)
    assert got.shape == (3, T, H, DV)
    for g, (qn, qp, kv_g, _, _) in enumerate(seqs):
        one = mla_prefill_sdpa(qn, qp, kv_g, w_uk, w_uv, SCALE)
        torch.testing.assert_close(got[g], one, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "L,T,G",
    [(1024, 1024, 0), (1024, 256, 0), (1003, 201, 0), (1024, 1024, 3), (517, 517, 2)],
    ids=["from-0", "after-prefix", "odd", "batched", "batched-odd"],
)
def test_sdpa_prefill_takes_a_fused_kernel_on_cuda(L, T, G):
    """mini's widths (qk 192, v 128) in bf16, with torch's math path ruled out: a fused kernel must take the
    call, one sequence or G of one shape (3-D inputs fell back to math: fp32 GEMMs and softmax, session 43), and
    it equals the reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kestrel.ops.mla.sdpa_prefill import mla_prefill_sdpa

    heads, dn, p, dv, r = 16, 128, 64, 128, 512
    g = torch.Generator(device="cuda").manual_seed(L + T)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    lead = (G,) if G else ()  # G sequences of one shape in one call, or one sequence unbatched
    q_nope, q_pe, kv = rnd(*lead, T, heads, dn), rnd(*lead, T, heads, p), rnd(*lead, L, r + p)
    w_uk, w_uv = rnd(heads, dn, r, scale=r**-0.5), rnd(heads, dv, r, scale=r**-0.5)
    scale = (dn + p) ** -0.5
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        got = mla_prefill_sdpa(q_nope, q_pe, kv, w_uk, w_uv, scale)
    pos = torch.arange(L - T, L, device="cuda")
    seqs = zip(q_nope, q_pe, kv) if G else [(q_nope, q_pe, kv)]
    for g, (qn, qp, kv_g) in enumerate(seqs):
        ref = mla_attention_absorbed(*(x.double() for x in (qn, qp, kv_g, w_uk, w_uv)), pos, scale)
        torch.testing.assert_close((got[g] if G else got).double(), ref, rtol=3e-2, atol=3e-2)


def _rows_mask(B: int, R: int, sparse: bool, seed: int) -> torch.Tensor:
    """[B, R, R] document-causal visibility of random packed documents, optionally thinned (every query keeps
    itself), as training's dense warm-up and its sparse DSA steps build it."""
    g = torch.Generator().manual_seed(seed)
    cuts = [torch.randint(1, R, (4,), generator=g).unique() for _ in range(B)]
    doc = torch.stack([torch.bucketize(torch.arange(R), c, right=True) for c in cuts])  # [B, R]
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(R, R, dtype=torch.bool).tril()
    if sparse:
        allowed &= torch.rand(B, R, R, generator=g) < 0.3
        allowed |= torch.eye(R, dtype=torch.bool)
    return allowed


@pytest.mark.parametrize("widths", [(96, 64), (192, 128)], ids=["demo", "mini"])
@pytest.mark.parametrize("sparse", [False, True])
def test_flex_rows_equal_dense_masked_attention(sparse, widths):
    """Training's FlexAttention path (KESTREL_TRAIN_ATTENTION=flex) against the dense masked SDPA, with qk and v
    widths that differ (the demo's MLA and mini's) and rows of 3 blocks of 128. On a GPU compiled, in bf16, with
    the tuned tiles where they apply (the H200), outputs and gradients; on the CPU flex's eager form, outputs only
    (it has no CPU backward)."""
    from kestrel.ops.mla.flex_rows import flex_attention_rows

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    B, H, R = 2, 3, 384
    g = torch.Generator().manual_seed(5)
    q, k = (
        torch.randn(B, H, R, widths[0], generator=g).to(dev, dtype).requires_grad_(cuda) for _ in range(2)
    )
    v = torch.randn(B, H, R, widths[1], generator=g).to(dev, dtype).requires_grad_(cuda)
    allowed = _rows_mask(B, R, sparse, seed=6).to(dev)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=0.1)
    got = flex_attention_rows(q, k, v, allowed, 0.1, compiled=cuda)
    tol = dict(rtol=2e-2, atol=2e-2) if cuda else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, **tol)
    if cuda:
        probe = torch.randn(B, H, R, widths[1], generator=g).to(dev, dtype)
        grads_ref = torch.autograd.grad((ref * probe).sum(), (q, k, v))
        grads = torch.autograd.grad((got * probe).sum(), (q, k, v))
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=0.1)


@pytest.mark.parametrize("sparse", [False, True])
def test_block_mask_from_dense_equals_create_block_mask(sparse):
    """The block mask read off the dense mask (no compile) lists the same blocks as flex's own
    create_block_mask: partial and full blocks, same dense form."""
    from torch.nn.attention.flex_attention import create_block_mask

    from kestrel.ops.mla.flex_rows import block_mask_from_dense

    allowed = _rows_mask(2, 384, sparse, seed=7)
    allowed[1, 128:256, 128:256] = torch.ones(128, 128, dtype=torch.bool).tril()  # a partial diagonal block
    allowed[1, 256:, 128:256] = True  # full blocks below it

    def visible(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    ours = block_mask_from_dense(allowed, 128, visible)
    ref = create_block_mask(visible, 2, None, 384, 384, device="cpu", BLOCK_SIZE=128)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert ours.full_kv_num_blocks[1, 0, 2] >= 1  # the full block above is listed as full
