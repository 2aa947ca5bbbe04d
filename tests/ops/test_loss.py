"""The LM loss chunked over tokens against the plain form (logits, then cross-entropy): the same per-token losses
and the same gradients of the hidden states and of the weight, with chunks that do not divide the tokens and
per-token gradient weights, in fp32 and under bf16 autocast; `token_losses` chunks only past its threshold (a
training step chunked and not: tests/train/test_trainer.py). `weighted_token_losses` (the gradients computed in
the forward) against the plain weighted sum the same way, with zero weights, and scaled by its upstream gradient."""

from __future__ import annotations

import functools

import pytest
import torch

import kestrel.ops.loss as lm_loss
from kestrel.ops.loss import (
    chunked_linear_cross_entropy,
    chunked_weighted_cross_entropy,
    linear_cross_entropy,
    token_losses,
    weighted_token_losses,
)


def _inputs(T=37, D=24, V=301, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * D**-0.5).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    scale = torch.rand(T, generator=g)  # the loss mask's weights
    return hidden, weight, targets, scale


def _grads(fn, hidden, weight, targets, scale):
    losses = fn(hidden, weight, targets)
    (losses * scale).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    return losses.detach(), grads


@pytest.mark.parametrize("rows", [1, 5, 16, 37, 64])
def test_chunked_equals_plain_in_fp32(rows):
    inputs = _inputs()
    want, (gh, gw) = _grads(linear_cross_entropy, *inputs)
    got, (ch, cw) = _grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, rows), *inputs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-6)


def test_chunked_under_bf16_autocast():
    """The matmuls in bf16 as the LM head runs them under autocast, the softmax in fp32: within bf16's rounding of
    the plain form, and the gradients come back in the inputs' dtypes (the fp32 master weight's in fp32)."""
    inputs = _inputs(T=50, D=32, V=257, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, (gh, gw) = _grads(linear_cross_entropy, *inputs)
        got, (ch, cw) = _grads(lambda h, w, t: chunked_linear_cross_entropy(h, w, t, 7), *inputs)
    assert cw.dtype == torch.float32 and ch.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in ((ch, gh), (cw, gw)):
        assert (a - b).norm() / b.norm() < 2e-2


def test_token_losses_chunks_only_past_the_threshold(monkeypatch):
    hidden, weight, targets, _ = _inputs()
    calls = []
    real = lm_loss.chunked_linear_cross_entropy
    monkeypatch.setattr(lm_loss, "chunked_linear_cross_entropy", lambda *a: calls.append(a[3]) or real(*a))
    token_losses(hidden, weight, targets)
    assert calls == []  # 37 x 301 logits: far below
    monkeypatch.setattr(lm_loss, "CHUNK_ABOVE", 1000)
    monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 3000)
    torch.testing.assert_close(
        token_losses(hidden, weight, targets), linear_cross_entropy(hidden, weight, targets)
    )
    assert calls == [3000 // 301]


def _plain_weighted(hidden, weight, targets, token_weights):
    losses = linear_cross_entropy(hidden, weight, targets)
    return (losses * token_weights).sum(), losses.detach()


def _weighted_grads(fn, hidden, weight, targets, token_weights, upstream=1.0):
    """fn's (weighted sum, losses) and the gradients of hidden and weight of upstream * its weighted sum."""
    total, losses = fn(hidden, weight, targets, token_weights)
    (upstream * total).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    return total.detach(), losses, grads


def _masked(scale: torch.Tensor) -> torch.Tensor:
    """Non-uniform token weights, 0 on every third token (off the loss mask) and on the first four."""
    keep = torch.arange(scale.shape[0]) % 3 != 0
    keep[:4] = False
    return scale * keep


@pytest.mark.parametrize("rows", [1, 5, 16, 37, 64])
def test_weighted_chunked_equals_plain_in_fp32(rows):
    hidden, weight, targets, scale = _inputs()
    token_weights = _masked(scale)
    want, want_losses, (gh, gw) = _weighted_grads(_plain_weighted, hidden, weight, targets, token_weights)
    chunked = functools.partial(chunked_weighted_cross_entropy, rows=rows)
    got, losses, (ch, cw) = _weighted_grads(chunked, hidden, weight, targets, token_weights)
    assert got.shape == () and got.dtype == torch.float32 and losses.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-6)
    assert (ch[token_weights == 0] == 0).all()  # off the loss mask: no gradient at all


@pytest.mark.parametrize("chunk", [False, True])
def test_weighted_token_losses_on_both_paths(chunk, monkeypatch):
    """The public op, plain (below the threshold) and chunked (past it, 3000 // 301 = 9 rows a chunk over 37
    tokens): the weighted sum with autograd, the losses without, the plain form's gradients."""
    hidden, weight, targets, scale = _inputs(seed=4)
    token_weights = _masked(scale * 3)
    calls = []
    real = lm_loss.chunked_weighted_cross_entropy
    monkeypatch.setattr(lm_loss, "chunked_weighted_cross_entropy", lambda *a: calls.append(a[4]) or real(*a))
    if chunk:
        monkeypatch.setattr(lm_loss, "CHUNK_ABOVE", 1000)
        monkeypatch.setattr(lm_loss, "CHUNK_ELEMENTS", 3000)
    total, losses = weighted_token_losses(hidden, weight, targets, token_weights)
    assert total.requires_grad and not losses.requires_grad
    want, want_losses, (gh, gw) = _weighted_grads(_plain_weighted, hidden, weight, targets, token_weights)
    got, losses, (ch, cw) = _weighted_grads(weighted_token_losses, hidden, weight, targets, token_weights)
    assert calls == ([3000 // 301] * 2 if chunk else [])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-6)


def test_weighted_chunked_scales_with_the_upstream_gradient():
    """The gradients computed in the forward are those of the weighted sum; the backward multiplies them by the
    gradient that reaches it (the trainer's 1 / total weight): 2.5 * sum gives 2.5 times the plain form's."""
    hidden, weight, targets, scale = _inputs(seed=5)
    token_weights = _masked(scale)
    _, _, (gh, gw) = _weighted_grads(_plain_weighted, hidden, weight, targets, token_weights)
    chunked = functools.partial(chunked_weighted_cross_entropy, rows=8)
    _, _, (ch, cw) = _weighted_grads(chunked, hidden, weight, targets, token_weights, upstream=2.5)
    torch.testing.assert_close(ch, 2.5 * gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cw, 2.5 * gw, rtol=1e-5, atol=1e-6)


def test_weighted_chunked_with_no_loss_token():
    """All token weights 0 (a batch without loss tokens): a zero sum, the losses still, and zero gradients."""
    hidden, weight, targets, _ = _inputs(seed=6)
    zeros = torch.zeros(hidden.shape[0])
    got, losses, (ch, cw) = _weighted_grads(
        functools.partial(chunked_weighted_cross_entropy, rows=10), hidden, weight, targets, zeros
    )
    assert got == 0 and (ch == 0).all() and (cw == 0).all()
    torch.testing.assert_close(losses, linear_cross_entropy(hidden, weight, targets).detach())


def test_weighted_chunked_under_bf16_autocast():
    """As `test_chunked_under_bf16_autocast`, for the weighted form."""
    hidden, weight, targets, scale = _inputs(T=50, D=32, V=257, seed=1)
    token_weights = _masked(scale)
    chunked = functools.partial(chunked_weighted_cross_entropy, rows=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_losses, (gh, gw) = _weighted_grads(_plain_weighted, hidden, weight, targets, token_weights)
        got, losses, (ch, cw) = _weighted_grads(chunked, hidden, weight, targets, token_weights)
    assert cw.dtype == torch.float32 and ch.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(losses, want_losses, rtol=2e-2, atol=2e-2)
    for a, b in ((ch, gh), (cw, gw)):
        assert (a - b).norm() / b.norm() < 2e-2
    assert (ch[token_weights == 0] == 0).all()


def test_weighted_chunked_backward_twice_is_refused():
    """The backward scales the gradients it saved in place: a second backward through the same graph
    (retain_graph) fails loudly instead of scaling them twice."""
    hidden, weight, targets, scale = _inputs(seed=7)
    total, _ = chunked_weighted_cross_entropy(hidden, weight, targets, scale, 10)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        total.backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_on_cuda_under_bf16_autocast():
    """The CUDA form (each chunk's softmax work compiled into one kernel over the bf16 logits, the weight's gradient
    accumulated in fp32 inside cuBLAS where torch can) against the plain form under the same autocast."""
    hidden, weight, targets, scale = (t.cuda() for t in _inputs(T=300, D=64, V=5003, seed=2))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, (gh, gw) = _grads(linear_cross_entropy, hidden, weight, targets, scale)
        got, (ch, cw) = _grads(
            lambda h, w, t: chunked_linear_cross_entropy(h, w, t, 128), hidden, weight, targets, scale
        )
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in ((ch, gh), (cw, gw)):
        assert (a - b).norm() / b.norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weighted_chunked_on_cuda_under_bf16_autocast():
    """The weighted form on CUDA (lse, target logit and gradient of a chunk in one compiled kernel) against the
    plain weighted sum under the same autocast, the fp32 master weight's gradient in fp32."""
    hidden, weight, targets, scale = (t.cuda() for t in _inputs(T=300, D=64, V=5003, seed=2))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    token_weights = _masked(scale.cpu()).cuda()
    chunked = functools.partial(chunked_weighted_cross_entropy, rows=128)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, want_losses, (gh, gw) = _weighted_grads(_plain_weighted, hidden, weight, targets, token_weights)
        got, losses, (ch, cw) = _weighted_grads(chunked, hidden, weight, targets, token_weights, upstream=0.5)
    assert cw.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(losses, want_losses, rtol=2e-2, atol=2e-2)
    for a, b in ((ch, 0.5 * gh), (cw, 0.5 * gw)):
        assert (a - b).norm() / b.norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_cublas", [True, False])
def test_weight_gradient_accumulates_in_fp32(in_cublas, monkeypatch):
    """The weight's gradient over chunks: fp32 sums of bf16 products, in cuBLAS (where this torch's addmm writes
    fp32 from bf16 in place) or as a product then an addition, both against an fp64 reference."""
    import kestrel.ops.loss.chunked as chunked

    if in_cublas and not chunked.fp32_accumulate_works():
        pytest.skip("this torch's addmm has no fp32 output for bf16 inputs")
    if not in_cublas:
        monkeypatch.setattr(chunked, "fp32_accumulate_works", lambda: False)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(64, 300, generator=g).bfloat16().cuda() for _ in range(5)]  # [C, V] a chunk
    hs = [torch.randn(64, 48, generator=g).bfloat16().cuda() for _ in range(5)]  # [C, D]
    acc = torch.zeros(300, 48, device="cuda")
    for gc, hc in zip(grads, hs):
        chunked._accumulate(acc, gc, hc)
    ref = sum(gc.double().t() @ hc.double() for gc, hc in zip(grads, hs))
    assert acc.dtype == torch.float32
    # each chunk's product rounded to bf16 would be off by ~2^-9 of it; fp32 accumulation is far closer
    assert ((acc.double() - ref).norm() / ref.norm()).item() < (1e-5 if in_cublas else 5e-3)
