"""KESTREL_COMPILE_TRAIN: the fused (torch.compile) ops give the eager ops' values and gradients, only while
autograd records."""

from __future__ import annotations

import torch

from kestrel.layers.context import ForwardContext, forward_context
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import init_random_weights
from kestrel.ops.norm import rms_norm
from kestrel.presets import preset_config


def _loss_and_grads(model, ids):
    ctx = ForwardContext.build([20, 12])
    ctx.row_len = 32
    model.zero_grad(set_to_none=True)
    with forward_context(ctx):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_training_step_equals_eager(monkeypatch):
    model = init_random_weights(KimiForCausalLM(preset_config("tiny")), seed=2)
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(0))
    loss, grads = _loss_and_grads(model, ids)
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    torch._dynamo.reset()
    compiled_loss, compiled_grads = _loss_and_grads(model, ids)
    assert torch.allclose(compiled_loss, loss, rtol=1e-5)
    for name, g in grads.items():
        assert torch.allclose(compiled_grads[name], g, rtol=1e-4, atol=1e-6), name
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # the compiled path really ran


def test_inference_keeps_the_eager_op(monkeypatch):
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "1")
    x, w = torch.randn(3, 8), torch.randn(8)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6))
