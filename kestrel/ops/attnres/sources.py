"""AttnRes mixing over training's bank, the sources given apart, with a backward that recomputes the mix.

Autograd through `attnres_mix_norm` keeps its stacked input [S, T, D] for the backward (compiled or eager), one
copy of its sources per consumer. On `mini` that is 168 source slices over 49 consumers, about 12 GB for one
8704-token row in fp32 (the bank was fp32 until its x0 took the autocast dtype), while the bank holds every source
anyway. Here the forward runs without autograd (on CUDA: the
Triton kernel the engine runs) and keeps only the sources; the backward stacks them again and differentiates the
op (compiled in training on CUDA). The extra cost is one more pass of the mix in the backward.
"""

from __future__ import annotations

import torch

from kestrel.ops.attnres.naive import attnres_mix_norm


class _MixNormSources(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, norm_weight, out_weight, eps: float, out_eps: float, *sources):
        ctx.eps, ctx.out_eps = eps, out_eps
        ctx.save_for_backward(query, norm_weight, out_weight, *sources)
        # fp32 math by definition (autocast would run its scores' matmul in bf16)
        with torch.no_grad(), torch.autocast(sources[0].device.type, enabled=False):
            return attnres_mix_norm(torch.stack(sources), query, norm_weight, eps, out_weight, out_eps)

    @staticmethod
    @torch.autograd.function.once_differentiable  # its recomputed graph is not kept: no double backward
    def backward(ctx, grad):
        needs = [*ctx.needs_input_grad[:3], *ctx.needs_input_grad[5:]]
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
        query, norm_weight, out_weight, *sources = inputs
        with torch.enable_grad(), torch.autocast(grad.device.type, enabled=False):
            out = attnres_mix_norm(torch.stack(sources), query, norm_weight, ctx.eps, out_weight, ctx.out_eps)
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        grads = [next(found) if t.requires_grad else None for t in inputs]
        return *grads[:3], None, None, *grads[3:]


def attnres_mix_norm_sources(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
) -> torch.Tensor:
    """`attnres_mix_norm(torch.stack(sources), ...)` (sources: S tensors [T, D]) whose autograd keeps the sources
    rather than their stack. Returns [T, D] in the stack's dtype."""
    return _MixNormSources.apply(query, norm_weight, out_weight, eps, out_eps, *sources)
