"""The clipped optimizer step against torch's clip_grad_norm_ followed by the step."""

from __future__ import annotations

import pytest
import torch

from kestrel.train.optim import clipped_step


def _params(seed: int, grad_scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((5, 7), (7,), (3, 2, 4))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * grad_scale
    return params


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("grad_scale", [0.01, 10.0], ids=["under-the-bound", "clipped"])
def test_clipped_step_equals_clip_grad_norm_then_step(fused, grad_scale):
    """Three steps: the parameters after `clipped_step` (fused AdamW: the factor inside the kernel as its
    grad_scale; else the gradients scaled in place) equal torch's clip_grad_norm_ then a plain AdamW step, with
    the gradients' norm under the bound (nothing to clip) and over it; the returned norm is the unclipped one."""
    ours, ref = _params(0, grad_scale), _params(0, grad_scale)
    kw = dict(lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    opt = torch.optim.AdamW(ours, fused=fused, **kw)
    opt_ref = torch.optim.AdamW(ref, foreach=False, **kw)
    for step in range(3):
        if step:
            for a, b in zip(ours, _params(step, grad_scale)):
                a.grad = b.grad.clone()
            for a, b in zip(ref, _params(step, grad_scale)):
                a.grad = b.grad.clone()
        norm = clipped_step(opt, 1.0)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt_ref.step()
        torch.testing.assert_close(norm, norm_ref)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not hasattr(opt, "grad_scale")  # nothing left for a later step (or a GradScaler) to find
    if grad_scale > 1:
        assert norm_ref > 1.0  # the clipped case did clip
