"""The expanded-form sparse MLA prefill kernel (kestrel.ops.mla.triton_prefill_expanded) against the plain-torch
reference `naive.mla_attention_absorbed` with the same selection, and without one against causal attention.

Without CUDA the kernel runs in Triton's interpreter on CPU (tests/conftest.py), in fp32. Sizes do not divide the
tiles; the output is allocated by the kernel's wrapper, so a row left unwritten shows as garbage or NaN only by
chance: rows are checked one by one against the reference, each non-zero, and an empty selection gives zeros.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from kestrel.ops.dsa.naive import selection_mask  # noqa: E402
from kestrel.ops.mla.naive import mla_attention_absorbed  # noqa: E402
from kestrel.ops.mla.triton_prefill_expanded import (  # noqa: E402
    selection_bits,
    sparse_mla_prefill_expanded,
    use_expanded,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(q0, T, k, H=3, R=32, Dn=16, P=8, Dv=16, seed=0, empty_row=None, dtype=torch.float32):
    """A chunk of T queries after q0 cached positions; indices in the top-k's layout (valid first, in position
    order, then -1), each row over a random causal subset of at most k positions."""
    g = torch.Generator().manual_seed(seed)
    L = q0 + T
    kv = torch.randn(L, R + P, generator=g)
    w_uk, w_uv = torch.randn(H, Dn, R, generator=g) * R**-0.5, torch.randn(H, Dv, R, generator=g) * R**-0.5
    q_nope, q_pe = torch.randn(T, H, Dn, generator=g), torch.randn(T, H, P, generator=g)
    indices = torch.full((T, k), -1, dtype=torch.int64)
    for t in range(T):
        chosen = torch.randperm(q0 + t + 1, generator=g)[: min(k, q0 + t + 1)]
        indices[t, : chosen.numel()] = chosen.sort().values
    if empty_row is not None:
        indices[empty_row] = -1
    return [
        x.to(DEVICE, dtype) if x.is_floating_point() else x.to(DEVICE) for x in (q_nope, q_pe, kv, w_uk, w_uv)
    ] + [indices.to(DEVICE)]


@pytest.mark.parametrize("q0, T, k", [(0, 37, 9), (21, 19, 7), (40, 6, 64), (3, 70, 33)])
@pytest.mark.parametrize(
    "tiles",
    [
        {"block_m": 16, "block_n": 32},
        {"block_m": 32, "block_n": 64},
    ],
)
def test_matches_the_reference_with_a_selection(q0, T, k, tiles):
    q_nope, q_pe, kv, w_uk, w_uv, indices = _case(q0, T, k, seed=q0 + T + k, empty_row=T // 2)
    pos = torch.arange(q0, q0 + T, device=DEVICE)
    seen = indices.clone()
    seen[T // 2, 0] = q0 + T // 2  # the reference refuses a row that sees nothing: that row is not compared
    ref = mla_attention_absorbed(q_nope, q_pe, kv, w_uk, w_uv, pos, 0.3, seen)
    got = sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.3, indices, **tiles)
    assert (got[T // 2] == 0).all()  # a row with no selection: zeros, as the decode kernel gives
    keep = torch.arange(T, device=DEVICE) != T // 2
    assert (got[keep].abs().amax(dim=(1, 2)) > 0).all()
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q0, T", [(0, 45), (30, 17)])
def test_without_a_selection_it_is_causal_attention(q0, T):
    q_nope, q_pe, kv, w_uk, w_uv, _ = _case(q0, T, 1, seed=7)
    pos = torch.arange(q0, q0 + T, device=DEVICE)
    ref = mla_attention_absorbed(q_nope, q_pe, kv, w_uk, w_uv, pos, 0.25)
    got = sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.25, block_m=16, block_n=32)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_positions_past_the_query_are_ignored():
    """A selection holding later positions (a replayed one could) reads none of them: the same as the reference,
    which masks them causally too."""
    q0, T, k = 5, 12, 6
    q_nope, q_pe, kv, w_uk, w_uv, indices = _case(q0, T, k, seed=4)
    indices[0, -1] = q0 + T - 1
    indices[5, -2:] = torch.tensor([q0 + 6, q0 + 9], device=DEVICE)
    pos = torch.arange(q0, q0 + T, device=DEVICE)
    ref = mla_attention_absorbed(q_nope, q_pe, kv, w_uk, w_uv, pos, 0.3, indices)
    got = sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.3, indices, block_m=16, block_n=32)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_bad_tiles_are_refused():
    q_nope, q_pe, kv, w_uk, w_uv, indices = _case(0, 4, 3, seed=1)
    with pytest.raises(AssertionError, match="block_n=16"):
        sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.3, indices, block_n=16)
    with pytest.raises(AssertionError, match="block_m=8"):
        sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.3, indices, block_m=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "tiles", [{}, {"block_m": 128, "block_n": 64}, {"block_m": 64, "block_n": 64, "num_warps": 4}]
)
def test_gpu_mini_sizes(tiles):
    """mini's sizes (16 heads, R 512, Dn 128, P 64, Dv 128), bf16: the last 1024 queries of a 4096-token prompt,
    top-2048 per row, against the fp32 reference (bf16 keys, values and probabilities: 2e-2)."""
    q_nope, q_pe, kv, w_uk, w_uv, _ = _case(
        3072, 1024, 1, H=16, R=512, Dn=128, P=64, Dv=128, dtype=torch.bfloat16
    )
    L, T, k = 4096, 1024, 2048
    pos = torch.arange(L - T, L, device=DEVICE)
    key = torch.rand(T, L, device=DEVICE).masked_fill(torch.arange(L, device=DEVICE) > pos[:, None], -1)
    top = key.topk(k, dim=-1)
    indices = torch.where(top.values >= 0, top.indices, -1)
    ref = mla_attention_absorbed(*(x.float() for x in (q_nope, q_pe, kv, w_uk, w_uv)), pos, 0.07, indices)
    got = sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.07, indices, **tiles)
    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 2e-2


@pytest.mark.parametrize(
    "q0, T, k, expanded",
    [
        (0, 4096, 2048, True),  # the H200's kernel bench (session 9): expanded 4.4x / 2.1x / 1.14x faster
        (12288, 4096, 2048, True),
        (28672, 4096, 2048, True),
        (0, 32768, 2048, True),  # the 1 x 32768 prefill step: 369 vs 499 ms
        (126976, 4096, 2048, False),  # the last 4096 of 128K: ~60x the selected pairs
        (32767, 1, 2048, False),  # short chunks after a long history: the expansion of the history dominates
        (32000, 128, 2048, False),
        (8192, 64, 2048, False),
    ],
)
def test_use_expanded_weighs_causal_against_selected_pairs(q0, T, k, expanded):
    """The closed form against counts row by row, and the choices expected at those shapes."""
    from kestrel.ops.mla.triton_prefill_expanded import EXPANDED_PAIR_COST_RATIO, EXPANSION_PAIRS_PER_ROW

    causal = sum(p + 1 for p in range(q0, q0 + T)) + EXPANSION_PAIRS_PER_ROW * (q0 + T)
    selected = sum(min(p + 1, k) for p in range(q0, q0 + T))
    assert use_expanded(q0, T, k) == (causal <= EXPANDED_PAIR_COST_RATIO * selected) == expanded


def test_a_replayed_layout_matches_the_reference():
    """A replayed selection need not list its entries first or in order: -1s scattered among them, shuffled rows,
    some entries past the query's own position."""
    q0, T, k = 9, 40, 12
    q_nope, q_pe, kv, w_uk, w_uv, indices = _case(q0, T, k, seed=11)
    g = torch.Generator().manual_seed(5)
    for t in range(T):
        row = indices[t].clone()
        row[torch.randperm(k, generator=g)[:3].to(DEVICE)] = -1  # holes among the valid entries
        if t % 3 == 0:
            row[0] = q0 + T - 1 if q0 + T - 1 > q0 + t else row[0]  # a future position, ignored
        indices[t] = row[torch.randperm(k, generator=g).to(DEVICE)]
    seen = torch.where(indices <= torch.arange(q0, q0 + T, device=DEVICE)[:, None], indices, -1)
    assert bool((seen >= 0).any(1).all())
    pos = torch.arange(q0, q0 + T, device=DEVICE)
    ref = mla_attention_absorbed(q_nope, q_pe, kv, w_uk, w_uv, pos, 0.3, seen)
    got = sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, 0.3, indices, block_m=16, block_n=32)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_a_replay_that_repeats_entries_is_not_taken_for_a_full_row():
    """A replayed selection may list a position twice: with distinct=False (the layer's choice under replay) the
    bitmap holds exactly the positions listed and no row counts as full, and the attention matches the
    reference; counting entries (distinct=True, the top-k's promise) would take [0, 0, 1] at position 2 for its
    whole past."""
    q0, T, k = 0, 20, 8
    q_nope, q_pe, kv, w_uk, w_uv, indices = _case(q0, T, k, seed=3)
    for t in range(2, T):  # every row from position 2: its first entry twice, in place of its last
        row = indices[t].clone()
        valid = int((row >= 0).sum())
        row[valid - 1] = row[0]
        indices[t] = row
    bits, full = selection_bits(indices, q0, q0 + T, distinct=False)
    L = q0 + T
    unpacked = ((bits[:, :, None] >> torch.arange(32, device=DEVICE)) & 1).reshape(T, -1)[:, :L] != 0
    assert torch.equal(unpacked, selection_mask(indices, L)) and not full.any()
    assert selection_bits(indices, q0, L)[1][2] == 1  # the count's mistake, which distinct=False avoids
    pos = torch.arange(q0, q0 + T, device=DEVICE)
    ref = mla_attention_absorbed(q_nope, q_pe, kv, w_uk, w_uv, pos, 0.3, indices)
    got = sparse_mla_prefill_expanded(
        q_nope, q_pe, kv, w_uk, w_uv, 0.3, indices, distinct=False, block_m=16, block_n=32
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q0, T, k", [(0, 37, 9), (40, 6, 64), (3, 70, 33), (100, 5, 40)])
def test_selection_bits_match_the_torch_bitmap(q0, T, k):
    """The one-kernel bitmap, unpacked, is the reference's selection mask of the causal part of each selection
    (bit 31, int32's sign bit, included), and `full` marks exactly the rows that selected their whole past."""
    *_, indices = _case(q0, T, k, seed=q0 * 3 + T + k, empty_row=T // 2)
    indices[1, -1] = q0 + T - 1 if q0 + T - 1 > q0 + 1 else -1  # a position past row 1's own: left out
    L = q0 + T
    bits, full = selection_bits(indices, q0, L)
    pos = torch.arange(q0, L, device=DEVICE)[:, None]
    causal = torch.where(indices <= pos, indices, -1)
    words = bits.shape[1]
    assert words == -(-L // 32)
    unpacked = (bits[:, :, None] >> torch.arange(32, device=DEVICE)) & 1  # [T, words, 32]
    assert torch.equal(unpacked.reshape(T, words * 32)[:, :L] != 0, selection_mask(causal, L))
    assert (unpacked.reshape(T, words * 32)[:, L:] == 0).all()
    want = ((causal >= 0).sum(1) == pos[:, 0] + 1).to(torch.int8)
    assert torch.equal(full, want) and want.any() == (q0 + 1 <= k)
    assert (bits != 0).any() and (bits < 0).any() == bool(((causal >= 0) & (causal % 32 == 31)).any())
