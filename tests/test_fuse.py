"""KESTREL_COMPILE_TRAIN: the fused (torch.compile) ops give the eager ops' values and gradients, only while
autograd records."""

from __future__ import annotations

import pytest
import torch

from kestrel.layers.context import ForwardContext, forward_context
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import init_random_weights
from kestrel.ops.norm import rms_norm
from kestrel.presets import preset_config


def _loss_and_grads(model, ids):
    ctx = ForwardContext.build([20, 12], device=ids.device)
    ctx.row_len = 32
    model.zero_grad(set_to_none=True)
    with forward_context(ctx):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_compiled_training_step_equals_eager(device, monkeypatch):
    model = init_random_weights(KimiForCausalLM(preset_config("tiny")), seed=2).to(device)
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(0)).to(device)
    loss, grads = _loss_and_grads(model, ids)
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    torch._dynamo.reset()
    compiled_loss, compiled_grads = _loss_and_grads(model, ids)
    # on CUDA the compiled kernels reduce in another order than eager's: agreement to fp32 rounding, not bits
    rtol, atol = (1e-5, 1e-6) if device == "cpu" else (1e-4, 1e-5)
    assert torch.allclose(compiled_loss, loss, rtol=rtol)
    for name, g in grads.items():
        assert torch.allclose(
            compiled_grads[name], g, rtol=10 * rtol, atol=atol * max(1.0, g.abs().max().item())
        ), name
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # the compiled path really ran


def test_inference_keeps_the_eager_op(monkeypatch):
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    x, w = torch.randn(3, 8), torch.randn(8)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6))
