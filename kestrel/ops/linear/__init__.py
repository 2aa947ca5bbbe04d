"""`linear(x, W)`: y = x W^T, through the Triton GEMV of `triton_gemv` for a few rows at inference where PDL is
on (decode on Hopper: each projection a graph node that launches with PDL and asks for its weights before it
waits), else through `naive.linear_reference` (cuBLAS). `linear_many`: one input's projections, in one GEMV launch
where it applies."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kestrel.env import env_field
from kestrel.ops.linear.naive import linear_reference
from kestrel.ops.pdl import pdl_on

# Up to this many rows (tokens) the GEMV runs, and up to this many output features (the LM head's 129K stay with
# cuBLAS, which reads them at the copy rate).
GEMV_MAX_ROWS = 16
GEMV_MAX_N = 16384
# Weights one GEMV launch takes at most (`linear_many`; MLA's projections of x: q, kv_a, the output gate, the indexer's
# q, k and weights).
GEMV_MAX_WEIGHTS = 6


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inference (autograd not recording, no autocast), 16-bit x and W of one dtype, W [N, K] contiguous with
    N <= GEMV_MAX_N, at most GEMV_MAX_ROWS rows, KESTREL_GEMV on, and a GPU where PDL is on (`gemv_on`:
    Hopper and later, the setup the GEMV was tuned and timed on; its 4-stage tiles need Hopper's shared memory).
    The path follows the row count: a token's projection may differ in the last bits between a batch of 16 and
    one of 17 (cuBLAS's own kernels change with the batch as well)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= GEMV_MAX_ROWS:  # first: prefill's calls leave before the environment is read
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[0] > GEMV_MAX_N:
        return False
    return not torch.is_autocast_enabled("cuda") and gemv_on(x.device)


def gemv_on(device: torch.device) -> bool:
    """The Triton GEMV may run on `device`: PDL is on there (Hopper and later) and KESTREL_GEMV is not off."""
    return pdl_on(device) and env_field("gemv") != "off"


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> [..., N] in x.dtype."""
    if gemv_applies(x, weight):
        from kestrel.ops.linear.triton_gemv import gemv_triton

        return gemv_triton(x, weight)
    return linear_reference(x, weight)


def fused_gemv_applies(fusion: str, x: torch.Tensor, weight: torch.Tensor, group: int = 1) -> bool:
    """x W^T may take `fusion` ("gate": `linear_gated`, "conv": `linear_conv`) inside the rows GEMV: the GEMV
    applies, KESTREL_GEMV_FUSE names it (or all; auto, the default: the gate at one row), the rows kernel takes
    x's rows and width (`rows_applies`), and `group` (the norm-gate's group of columns) is a power of two
    dividing the width. Why auto is the gate at one row: `kestrel.env.Env.gemv_fuse`."""
    width = x.shape[-1]
    if group & (group - 1) or width % group:
        return False
    rows = x.numel() // width
    fuse = env_field("gemv_fuse")
    wanted = fuse in (fusion, "all") or (fuse == "auto" and fusion == "gate" and rows == 1)
    if not wanted or not gemv_applies(x, weight):
        return False
    from kestrel.ops.linear.triton_gemv import rows_applies

    return rows_applies(rows, width)


def linear_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None
) -> torch.Tensor:
    """linear(h, W) where h is x through its output gate, made inside the GEMV (where
    `fused_gemv_applies("gate", ...)`): with norm = (weight [G], eps) KDA's `gated_rms_norm` over each group of
    G columns, else MLA's `sigmoid_gate`. x, gate [..., K]."""
    from kestrel.ops.linear.triton_gemv import gemv_triton

    return gemv_triton(x, weight, kernel="rows", gate=gate, norm=norm)


def linear_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    planes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(x, W), KDA's short-conv decode step on its first C columns), the step inside the GEMV (where
    `fused_gemv_applies("conv", ...)`): x [M, K], W [N, K], conv_weight [C, W], conv_pool [S, C, W - 1] advanced
    in place at slots [M]. Returns the projection [M, N] and the conv's SiLU outputs as planes [planes, M,
    C / planes] (`triton_conv.conv_step_inplace(out[:, :C], ..., planes=planes)`)."""
    from kestrel.ops.linear.triton_gemv import gemv_triton

    C = conv_weight.shape[0]
    out_planes = x.new_empty(planes, x.shape[0], C // planes)
    out = gemv_triton(x, weight, kernel="rows", conv=(conv_weight, conv_pool, slots, out_planes))
    return out, out_planes


def linear_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """[linear(x_i, W_i)] for (x_i, W_i) in pairs. Where every x_i is one tensor's data (x and x.detach(), say)
    and the GEMV applies to each pair, in one launch (`gemv_many_triton`); else one `linear` a pair, so that
    autograd sees each x_i as given (a detached input stays cut from the graph)."""
    x = pairs[0][0] if pairs else None
    if (
        1 < len(pairs) <= GEMV_MAX_WEIGHTS
        and all(_same_data(xi, x) for xi, _ in pairs)
        and all(gemv_applies(xi, w) for xi, w in pairs)
    ):
        from kestrel.ops.linear.triton_gemv import gemv_many_triton

        return gemv_many_triton(x, [w for _, w in pairs])
    return [linear(xi, w) for xi, w in pairs]


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


__all__ = [
    "GEMV_MAX_N",
    "GEMV_MAX_ROWS",
    "GEMV_MAX_WEIGHTS",
    "fused_gemv_applies",
    "gemv_applies",
    "linear",
    "linear_conv",
    "linear_gated",
    "linear_many",
    "linear_reference",
]
