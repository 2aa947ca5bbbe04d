"""Gated activations of the GLU MLPs (model-spec section 3.2), computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.utils.fuse import for_training, fused, records


@fused("kestrel.ops.activation.triton_act:swiglu_triton")
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


@fused("kestrel.ops.activation.triton_act:situ_triton")
def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU (Kimi K3): beta*tanh(gate/beta)*sigmoid(gate) * linear_beta*tanh(up/linear_beta).

    A soft-capped SiLU on the gate branch times a soft-capped linear up branch.
    """
    a, b = gate.float(), up.float()
    capped_gate = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    capped_up = linear_beta * torch.tanh(b / linear_beta)
    return (capped_gate * capped_up).to(gate.dtype)


@fused("kestrel.ops.activation.triton_act:sigmoid_gate_triton")
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): the sigmoid in fp32, rounded to x's dtype, then the product in x's dtype (MLA's output
    gate, model-spec 2.2). gate has x's shape, or x's shape flattened from its second dim on ([T, H * Dv] for
    x [T, H, Dv]: the gate projection's output as it comes)."""
    return x * torch.sigmoid(gate.float()).view(x.shape).to(x.dtype)


def glu_act(gate_up: torch.Tensor, act: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Split `[..., 2I]` into gate and up halves and apply `act` ('silu' or 'situ').

    While autograd records, the split and the activation go through `for_training` as one function (compiled on
    CUDA): its backward writes gate_up's gradient in one piece, where the two halves' gradients would otherwise be
    concatenated by the split's backward (a `cat` of [M, 2I] a MoE layer, routed and shared: 48 a step on
    `mini`). Without autograd, the halves go to `swiglu` / `situ` (their Triton kernels at inference)."""
    if act not in ("silu", "situ"):
        raise ValueError(f"unknown activation {act!r}")
    if records(gate_up):
        return for_training(_glu, gate_up)(gate_up, act, situ_beta, situ_linear_beta, True)
    return _glu(gate_up, act, situ_beta, situ_linear_beta, False)


def _glu(gate_up: torch.Tensor, act: str, situ_beta: float, situ_linear_beta: float, eager: bool):
    """The halves through the activation: as written (eager: inside the one compiled function of training) or as
    the fused ops pick (their Triton kernels at inference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return (swiglu.eager if eager else swiglu)(gate, up)
    return (situ.eager if eager else situ)(gate, up, situ_beta, situ_linear_beta)
