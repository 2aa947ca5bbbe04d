"""DSA indexer and exact top-k: hand-made ties, a brute-force tie oracle, fla-core and transformers parity.

Legend: T queries, L cached tokens, HI indexer heads, DI indexer head dim, k = index_topk.
"""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.ops.dsa import indexer_scores, indexer_scores_batched, selection_mask, topk_select
from tests.ops.graph_check import assert_replay_matches_eager

NAN, INF = float("nan"), float("inf")


def pos(*p):
    return torch.tensor(p, dtype=torch.int64)


def oracle_topk(scores, q_pos, k):
    """The tie rule in plain Python: sort valid causal positions by (score desc, position asc)."""
    out = []
    for t, row in enumerate(scores.tolist()):
        cands = [(-v, s) for s, v in enumerate(row) if s <= q_pos[t] and not math.isnan(v)]
        chosen = [s for _, s in sorted(cands)[:k]]
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out, dtype=torch.int64)


def test_indexer_scores_formula():
    g = torch.Generator().manual_seed(0)
    T, L, HI, DI = 5, 9, 3, 8
    q = torch.randn(T, HI, DI, generator=g)
    k = torch.randn(L, DI, generator=g)
    w = torch.randn(T, HI, generator=g)
    out = indexer_scores(q, k, w, DI**-0.5)
    assert out.dtype == torch.float32 and out.shape == (T, L)
    ref = torch.zeros(T, L, dtype=torch.float64)
    for t in range(T):
        for s in range(L):
            for j in range(HI):
                ref[t, s] += w[t, j].double() * max(0.0, float(q[t, j].double() @ k[s].double())) * DI**-0.5
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # bf16 inputs are scored in fp32
    assert indexer_scores(q.bfloat16(), k.bfloat16(), w.bfloat16(), DI**-0.5).dtype == torch.float32


def test_all_equal_scores_pick_lowest_positions():
    T, L, k = 8, 8, 3
    idx = topk_select(torch.zeros(T, L), torch.arange(T), k)
    expected = [[0, -1, -1], [0, 1, -1]] + [[0, 1, 2]] * (T - 2)
    assert idx.tolist() == expected


def test_mixed_ties_rank_order():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 1.0, 9.0]])  # position 6 is in the future
    assert topk_select(scores, pos(5), 4).tolist() == [[1, 2, 4, 3]]
    assert topk_select(scores, pos(5), 5).tolist() == [[1, 2, 4, 3, 0]]
    assert topk_select(scores, pos(5), 2).tolist() == [[1, 2]]
    assert topk_select(scores, pos(6), 2).tolist() == [[6, 1]]
    # -0.0 == +0.0, so they tie and the lower position wins either way round
    assert topk_select(torch.tensor([[0.0, -0.0, -0.0, 0.0]]), pos(3), 4).tolist() == [[0, 1, 2, 3]]


def test_nan_is_invalid():
    scores = torch.tensor([[NAN, 5.0, NAN, 1.0], [NAN, NAN, NAN, NAN]])
    assert topk_select(scores, pos(3, 3), 3).tolist() == [[1, 3, -1], [-1, -1, -1]]


def test_infinite_scores_are_real_but_masked_never_win():
    # -inf is a genuine (lowest) score, still selected ahead of padding; the future +inf and a NaN are not.
    scores = torch.tensor([[-INF, 2.0, NAN, -INF, INF]])
    assert topk_select(scores, pos(3), 4).tolist() == [[1, 0, 3, -1]]
    assert topk_select(scores, pos(4), 2).tolist() == [[4, 1]]


def test_fewer_visible_than_k_pads():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 6, generator=g)
    idx = topk_select(scores, pos(0, 2, 5), 10)
    assert idx.shape == (3, 10)
    assert idx[0].tolist() == [0] + [-1] * 9
    assert sorted(idx[1, :3].tolist()) == [0, 1, 2] and (idx[1, 3:] == -1).all()
    assert sorted(idx[2, :6].tolist()) == list(range(6)) and (idx[2, 6:] == -1).all()


def test_rank_order_best_first():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(4, 30, generator=g)
    q_pos = pos(29, 12, 20, 5)
    idx = topk_select(scores, q_pos, 6)
    for t in range(4):
        valid = idx[t][idx[t] >= 0]
        vals = scores[t, valid]
        assert (vals[:-1] > vals[1:]).all()


@pytest.mark.parametrize("seed", range(4))
def test_matches_oracle_with_heavy_ties(seed):
    g = torch.Generator().manual_seed(seed)
    T, L = 12, 50
    scores = torch.randint(-3, 4, (T, L), generator=g).float()  # 7 distinct values: ties everywhere
    scores[torch.rand(T, L, generator=g) < 0.1] = NAN
    q_pos = torch.randint(0, L, (T,), generator=g)
    for k in (1, 7, 16, 49, 50, 64):
        assert torch.equal(topk_select(scores, q_pos, k), oracle_topk(scores, q_pos, k))


def test_long_row_ties_keep_position_order():
    # Long rows exercise the sort beyond any small-size fast path.
    g = torch.Generator().manual_seed(3)
    L = 5000
    scores = torch.randint(0, 3, (2, L), generator=g).float()
    q_pos = pos(L - 1, 3210)
    assert torch.equal(topk_select(scores, q_pos, 2048), oracle_topk(scores, q_pos, 2048))


def test_k_at_least_length_selects_causal_set():
    g = torch.Generator().manual_seed(4)
    T, L = 6, 17
    scores = torch.randn(T, L, generator=g)
    q_pos = pos(0, 4, 16, 9, 11, 2)
    for k in (L, L + 5):
        idx = topk_select(scores, q_pos, k)
        for t in range(T):
            assert sorted(idx[t][idx[t] >= 0].tolist()) == list(range(int(q_pos[t]) + 1))
            assert (idx[t][int(q_pos[t]) + 1 :] == -1).all()
        mask = selection_mask(idx, L)
        assert torch.equal(mask, torch.arange(L)[None, :] <= q_pos[:, None])


def test_selection_mask():
    idx = torch.tensor([[2, -1, 0], [-1, -1, -1], [4, 3, 1]])
    assert selection_mask(idx, 5).int().tolist() == [[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 1]]


def assert_no_ties(scores):
    """Parity with a selector that breaks ties arbitrarily needs distinct causal scores in every row.

    An all-negative head sum after ReLU gives an exact 0 per head, so few heads make exact-zero ties likely.
    """
    for t, row in enumerate(scores.tolist()):
        assert len(set(row[: t + 1])) == t + 1, f"row {t} has tied scores; pick another seed"


def row_sets(idx, limit=None):
    """indices [T, k] -> per-row set of selected positions; with `limit`, drop positions beyond limit[t]."""
    rows = idx.tolist()
    return [{s for s in row if s >= 0 and (limit is None or s <= limit[t])} for t, row in enumerate(rows)]


@pytest.mark.parametrize("T,topk", [(33, 8), (64, 16), (20, 32)])
def test_matches_fla_naive_indexer(T, topk):
    fla_naive = pytest.importorskip("fla.ops.dsa.naive")
    g = torch.Generator().manual_seed(T)
    HI, DI = 16, 16
    q = torch.randn(T, HI, DI, generator=g)  # [T, HI, DI]
    k = torch.randn(T, DI, generator=g)  # [T, DI]
    w = torch.randn(T, HI, generator=g)  # [T, HI]
    scale = DI**-0.5
    ref = fla_naive.naive_dsa_indexer(q[None], k[None], w[None], topk=topk, scale=scale, activation="relu")[0]
    scores = indexer_scores(q, k, w, scale)  # [T, T]
    assert_no_ties(scores)
    ours = topk_select(scores, torch.arange(T), topk)
    assert ref.shape == ours.shape == (T, topk)
    assert row_sets(ours) == row_sets(ref)


def test_matches_transformers_deepseek_v32_indexer():
    pytest.importorskip("transformers")
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

    T, D, RQ, HI, DI, PR, TOPK = 40, 64, 48, 16, 32, 16, 12
    cfg = DeepseekV32Config(
        hidden_size=D,
        q_lora_rank=RQ,
        index_n_heads=HI,
        index_head_dim=DI,
        index_topk=TOPK,
        qk_rope_head_dim=PR,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    indexer = DeepseekV32Indexer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for lin in (indexer.wq_b, indexer.wk, indexer.weights_proj):
            lin.weight.copy_(torch.randn_like(lin.weight) * lin.weight.shape[1] ** -0.5)
        indexer.k_norm.weight.copy_(1 + 0.5 * torch.randn(DI))  # non-trivial affine LayerNorm
        indexer.k_norm.bias.copy_(0.5 * torch.randn(DI))
    x = torch.randn(1, T, D)  # [1, T, D]
    q_resid = torch.randn(1, T, RQ)  # [1, T, RQ]
    # cos = 1, sin = 0 makes its RoPE the identity: NoPE, as in Kimi.
    rope = (torch.ones(1, T, PR), torch.zeros(1, T, PR))
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]  # [1, T, T]
    ref = indexer(x, q_resid, rope, causal, torch.arange(T)[None])[0].long()  # [T, TOPK]

    with torch.no_grad():
        q_idx = indexer.wq_b(q_resid[0]).view(T, HI, DI)  # [T, HI, DI]
        ln = indexer.k_norm
        k_idx = torch.nn.functional.layer_norm(indexer.wk(x[0]), (DI,), ln.weight, ln.bias, ln.eps)  # [T, DI]
        weights = indexer.weights_proj(x[0]) * HI**-0.5  # [T, HI]
    scores = indexer_scores(q_idx, k_idx, weights, DI**-0.5)  # [T, T]
    assert_no_ties(scores)
    ours = topk_select(scores, torch.arange(T), TOPK)
    # Its topk fills early rows with masked (-inf) future positions; only the causal ones count.
    assert row_sets(ours) == row_sets(ref, limit=list(range(T)))
    assert all(len(s) == min(TOPK, t + 1) for t, s in enumerate(row_sets(ours)))


# ---------------------------------------------------------------- batched decode (one query per sequence)


def make_batched(lens, Lmax, HI=4, DI=16, seed=20, device="cpu"):
    """Indexer inputs for B = len(lens) sequences; keys at positions >= lens[b] are garbage (NaN, +inf)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    q = torch.randn(B, HI, DI, generator=g)  # [B, HI, DI]
    k = torch.randn(B, Lmax, DI, generator=g)  # [B, Lmax, DI]
    w = torch.randn(B, HI, generator=g)  # [B, HI]
    lens = torch.tensor(lens, dtype=torch.int64)
    padded = torch.arange(Lmax)[None, :] >= lens[:, None]  # [B, Lmax]
    k[padded] = torch.where(torch.rand(int(padded.sum()), 1, generator=g) < 0.5, NAN, INF)
    return q.to(device), k.to(device), w.to(device), lens.to(device)


@pytest.mark.parametrize("k", [1, 5, 40])
def test_batched_indexer_and_topk_equal_per_row(k):
    Lmax = 30
    lens = [1, 17, Lmax, 5, 29, 2]
    q, k_idx, w, lens_t = make_batched(lens, Lmax)
    scale = k_idx.shape[-1] ** -0.5
    scores = indexer_scores_batched(q, k_idx, w, scale)  # [B, Lmax]
    assert scores.dtype == torch.float32 and scores.shape == (len(lens), Lmax)
    idx = topk_select(scores, lens_t - 1, k)  # [B, k]
    for b, n in enumerate(lens):
        ref = indexer_scores(q[b : b + 1], k_idx[b, :n], w[b : b + 1], scale)  # [1, n]
        torch.testing.assert_close(scores[b : b + 1, :n], ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(idx[b : b + 1], topk_select(ref, pos(n - 1), k))


def test_topk_ignores_garbage_past_q_pos():
    g = torch.Generator().manual_seed(21)
    Lmax, lens = 25, pos(1, 9, 25, 14)
    scores = torch.randn(4, Lmax, generator=g)
    padded = torch.arange(Lmax)[None, :] >= lens[:, None]
    expected = topk_select(scores, lens - 1, 8)
    for garbage in (NAN, INF, -INF, 1e30):
        assert torch.equal(topk_select(scores.masked_fill(padded, garbage), lens - 1, 8), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_indexer_and_topk_cuda_graph():
    Lmax, topk = 300, 64
    lens = [1, 17, Lmax, 64, 299, 2, 150, 65]

    def bf16_inputs(lens, seed):
        q, k_idx, w, lens_t = make_batched(lens, Lmax, HI=8, DI=64, seed=seed, device="cuda")
        return q.bfloat16(), k_idx.bfloat16(), w.bfloat16(), lens_t

    first, fresh = bf16_inputs(lens, 22), bf16_inputs(lens[::-1], 23)
    q, k_idx, w, lens_t = first
    scale = 64**-0.5
    scores = indexer_scores_batched(q, k_idx, w, scale)
    for b, n in enumerate(lens):  # bf16 inputs are scored in fp32 either way
        ref = indexer_scores(q[b : b + 1], k_idx[b, :n], w[b : b + 1], scale)
        torch.testing.assert_close(scores[b : b + 1, :n], ref, rtol=1e-5, atol=1e-5)

    def step(q, k_idx, w, lens):
        scores = indexer_scores_batched(q, k_idx, w, scale)  # [B, Lmax]
        return scores.nan_to_num(), topk_select(scores, lens - 1, topk)

    assert_replay_matches_eager(step, first, fresh)
