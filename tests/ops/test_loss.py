"""The LM loss chunked over tokens against the plain form (logits, then cross-entropy): the same per-token losses
and the same gradients of the hidden states and of the weight, with chunks that do not divide the tokens and
per-token gradient weights, in fp32 and under bf16 autocast; `token_losses` chunks only past its threshold (a
training step chunked and not: tests/train/test_trainer.py)."""

from __future__ import annotations

import pytest
import torch

import kestrel.ops.loss as lm_loss
from kestrel.ops.loss import chunked_linear_cross_entropy, linear_cross_entropy, token_losses


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
