"""RMSNorm and LayerNorm references: fp32 compute, result in the input dtype."""

from __future__ import annotations

import torch

from kestrel.utils.fuse import fused


@fused("kestrel.ops.norm.triton_norm:rms_norm_triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim, computed in fp32.  x: [..., D], weight: [D]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


@fused("kestrel.ops.norm.triton_norm:layer_norm_triton")
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with weight and bias, in fp32."""
    out = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return out.to(x.dtype)
