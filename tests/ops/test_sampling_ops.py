"""The sampler's fast ops against their references: the logprobs in Triton (kestrel.ops.sampling.triton_logprobs)
against torch.log_softmax and topk (`naive.token_logprobs`): rows picked out, widths that do not divide the
chunks, ties within and across chunks, k from 0 to 20, -inf columns, bf16; and the penalties at the seen tokens
only (`naive.apply_penalties_at`) against the dense `naive.apply_penalties`, bit for bit. Without CUDA the
kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.sampling import naive

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check_logprobs(x: torch.Tensor, tokens: torch.Tensor, k: int, rows: list[int] | None = None, **kw):
    pytest.importorskip("triton")
    from kestrel.ops.sampling.triton_logprobs import token_logprobs_triton

    idx = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=x.device)
    chosen, top_v, top_i = token_logprobs_triton(x, tokens, k, idx, **kw)
    sel = slice(None) if rows is None else rows
    raw = x.cpu().double()[sel]
    # the reference in fp64 (torch's CPU log_softmax in fp32 is off by ~1e-5 at 129K columns: farther than ours)
    ref_c, ref_v, ref_i = naive.token_logprobs(raw, tokens.cpu()[sel], k)
    lp = torch.log_softmax(raw, -1)
    ref_c, ref_v = lp.gather(1, tokens.cpu()[sel][:, None])[:, 0], lp.gather(1, ref_i)
    b = ref_c.shape[0]
    assert chosen.shape == (b,) and top_v.shape == (b, k) and top_i.shape == (b, k)
    assert chosen.dtype == top_v.dtype == torch.float32 and top_i.dtype == torch.int64
    torch.testing.assert_close(chosen.cpu().double(), ref_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(top_v.cpu().double(), ref_v, rtol=1e-6, atol=1e-6)
    # the same logits at the same ranks; the ids equal up to the order of tied values (torch leaves it open)
    assert torch.equal(raw.gather(1, top_i.cpu()), raw.gather(1, ref_i))
    for j in range(b):  # ties: the first columns among the equal values, ascending
        for i in range(1, k):
            if top_v[j, i - 1] == top_v[j, i]:
                assert top_i[j, i - 1] < top_i[j, i]
        assert len(set(top_i[j].tolist())) == k
    return chosen, top_v, top_i


@pytest.mark.parametrize("B,V", [(1, 7), (3, 2049), (2, 5000), (2, 129280)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_match_log_softmax(B, V, dtype, k):
    if k > V:
        pytest.skip("k past the vocabulary")
    g = torch.Generator().manual_seed(B * V + k)
    x = (torch.randn(B, V, generator=g) * 4).to(DEVICE, dtype)
    tokens = torch.randint(0, V, (B,), generator=g).to(DEVICE)
    _check_logprobs(x, tokens, k)


def test_rows_picked_out_and_other_chunk_widths():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 9000, generator=g).to(DEVICE)
    tokens = torch.randint(0, 9000, (5,), generator=g).to(DEVICE)
    for block in (1024, 8192):
        _check_logprobs(x, tokens, 4, rows=[4, 1], block=block)
    _check_logprobs(x, tokens, 3, rows=[])
    # rows and tokens of another dtype or stride are read as given
    from kestrel.ops.sampling.triton_logprobs import token_logprobs_triton

    strided = torch.stack([tokens, tokens.flip(0)], 1)[:, 1]
    rows32 = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    got = token_logprobs_triton(x, strided, 2, rows32)
    want = token_logprobs_triton(x, strided.contiguous(), 2, rows32.long())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.testing.assert_close(
        got[0].cpu().double(), torch.log_softmax(x.cpu().double(), -1)[[3, 0], strided.cpu()[[3, 0]]]
    )


def test_ties_across_chunks_and_minus_infinity():
    """Equal maxima in three chunks (2048 wide) come out first column first; -inf columns (and a chunk of them)
    add nothing to the sum and are never among the top unless nothing else is left."""
    V = 6000
    x = torch.full((3, V), -2.0)
    x[0, [10, 2100, 5999]] = 3.0
    x[1, :4096] = float("-inf")  # two whole chunks
    x[1, 4500] = 1.0
    x[2] = torch.linspace(-5, 5, V)
    x[2, 2047], x[2, 2048] = 9.0, 9.0  # the chunk boundary
    tokens = torch.tensor([2100, 4500, 0])
    chosen, top_v, top_i = _check_logprobs(x.to(DEVICE), tokens.to(DEVICE), 5)
    assert top_i[0, :3].tolist() == [10, 2100, 5999]
    assert top_i[1, 0].item() == 4500 and top_i[1, 1].item() == 4096
    assert top_i[2, :2].tolist() == [2047, 2048]


def test_dispatch_and_bad_input():
    from kestrel.ops.sampling import token_logprobs

    x = torch.randn(3, 100, device=DEVICE)
    tokens = torch.tensor([1, 2, 3], device=DEVICE)
    rows = torch.tensor([2, 0], device=DEVICE)
    got = token_logprobs(x, tokens, 2, rows)
    want = naive.token_logprobs(x[[2, 0]], tokens[[2, 0]], 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    pytest.importorskip("triton")
    from kestrel.ops.sampling.triton_logprobs import token_logprobs_triton

    with pytest.raises(AssertionError, match="at most 20"):
        token_logprobs_triton(x, tokens, 21)
    with pytest.raises(AssertionError, match="rows"):
        token_logprobs_triton(x[:, ::2], tokens, 2)


def _penalty_case(B: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, :5] = torch.tensor([0.0, -0.0, float("-inf"), 2.0, -2.0])
    seen_rows, seen_ids = [], []
    counts = torch.zeros(B, V)
    seen = torch.zeros(B, V, dtype=torch.bool)
    for b in range(B):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        out = torch.randint(0, V, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g)
        if b == 0:  # the special values seen; token 3 twice in the prompt and twice more in the output
            prompt = torch.cat([prompt, torch.arange(5), torch.tensor([3])])
            out = torch.cat([out, torch.tensor([3, 3])])
        for t in out.tolist():
            counts[b, t] += 1
        ids = torch.cat([prompt, out])
        seen[b, ids] = True
        seen_rows.append(torch.full_like(ids, b))
        seen_ids.append(ids)
    rep = torch.rand(B, generator=g) + 0.5
    freq = torch.rand(B, generator=g) * 2 - 0.5
    pres = torch.rand(B, generator=g) * 2 - 1
    return logits, counts, seen, torch.cat(seen_rows), torch.cat(seen_ids), rep, freq, pres


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_at_the_seen_tokens_equal_the_dense_ones(dtype):
    logits, counts, seen, rows, cols, rep, freq, pres = _penalty_case(4, 3000, 7)
    logits = logits.to(dtype)
    before = logits.clone()
    dense = naive.apply_penalties(logits, counts, seen, rep, freq, pres)
    at = naive.apply_penalties_at(logits, counts, rows, cols, rep, freq, pres)
    assert at.dtype == torch.float32 and at is not logits
    same = at.view(torch.int32) == dense.view(torch.int32)  # bit for bit: -0.0 is not +0.0 here (no NaN in)
    assert bool(same.all()), (at[~same], dense[~same])
    assert counts[0, 3] >= 2 and len(set(zip(rows.tolist(), cols.tolist()))) < rows.numel()  # repeats seen
    assert torch.equal(logits, before)  # the logits themselves untouched
    if DEVICE == "cuda":
        on = [t.to(DEVICE) for t in (logits, counts, rows, cols, rep, freq, pres)]
        assert torch.equal(naive.apply_penalties_at(*on).cpu(), at)
