"""`kestrel.ops.sampling.naive.process_logits` and `sample`, the sampler's reference path on every device: the
top-k / top-p / min-p sets against a per-row loop, and the rows that used to lose every token."""

import math

import pytest
import torch

from kestrel.ops.sampling.naive import process_logits, sample


def _params(B, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (
        torch.full((B,), float(temperature)),
        torch.full((B,), top_k, dtype=torch.int64),
        torch.full((B,), float(top_p)),
        torch.full((B,), float(min_p)),
    )


def _kept_by_loop(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a row keeps, one at a time in float64: the top k (ties kept), then the smallest prefix of them
    whose mass reaches top_p (ties at its last entry kept), then those at least min_p times the most likely."""
    order = sorted(range(row.numel()), key=lambda i: -row[i].item())
    logits = [row[i].item() for i in order]
    if top_k:
        logits = [v for v in logits if v >= logits[top_k - 1]]
    z = sum(math.exp(v - logits[0]) for v in logits)
    mass, kept = 0.0, []
    for v in logits:
        if kept and mass >= top_p and v < kept[-1]:
            break
        kept.append(v)
        mass += math.exp(v - logits[0]) / z
    return {order[i] for i, v in enumerate(kept) if math.exp(v - logits[0]) >= min_p}


@pytest.mark.parametrize("top_p", [1e-9, 1e-3, 0.1, 0.5, 0.9, 1.0])
def test_every_row_keeps_its_most_likely_token(top_p):
    """Rows peaked enough that top-p keeps one token: the softmax of the sorted logits and that of the unsorted
    ones differ in their last bit, so a cut taken from one and compared with the other dropped that token too
    (then 0 / 0, and token 0 sampled: the served model wrote <|bos|> mid-answer at top_p 0.9)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(600, 4096, generator=g) * 4
    logits[:, 7] += torch.rand(600, generator=g) * 12  # a clear favourite in most rows
    probs = process_logits(logits, *_params(600, top_p=top_p))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(600))
    best = logits.argmax(-1)
    assert (probs.gather(1, best[:, None]) > 0).all()
    drawn = sample(probs, torch.arange(600), torch.zeros(600, dtype=torch.int64))
    if top_p <= 1e-3:  # a tiny top_p is greedy
        assert torch.equal(drawn, best)
    assert (probs.gather(1, drawn[:, None]) > 0).all()


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.7, 0.0), (5, 1.0, 0.0), (5, 0.5, 0.0), (0, 1.0, 0.2),
                                               (3, 0.9, 0.05)])  # fmt: skip
def test_kept_tokens_match_a_loop(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 40, generator=g) * 2
    logits[3, :4] = 5.0  # a tie at the top
    logits[5, [2, 9, 30]] = 1.5  # ties around the cut
    probs = process_logits(logits, *_params(16, top_k=top_k, top_p=top_p, min_p=min_p))
    for b in range(16):
        got = set(torch.nonzero(probs[b]).flatten().tolist())
        assert got == _kept_by_loop(logits[b].double(), top_k, top_p, min_p), b


def test_infinite_and_nan_logits_still_give_a_distribution():
    """A repetition penalty near 0 divides a positive logit into +inf; a NaN must not win either."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    logits[0, 4] = float("inf")
    logits[1, [4, 8]] = float("inf")
    logits[2, 0] = float("nan")
    probs = process_logits(logits, *_params(3, top_p=0.9))
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {4}
    assert set(torch.nonzero(probs[1]).flatten().tolist()) == {4, 8}
    assert probs[2, 0] == 0
