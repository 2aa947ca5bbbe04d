"""KDA's log-space decay in one Triton kernel: `naive.kda_gate` (fp32) for inference on CUDA, both
parameterizations (Kimi-Linear's softplus, K3's lower-bound sigmoid). Legend: N rows, H heads, K head dim."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.norm.triton_norm import as_rows
from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def _gate_kernel(
    f_ptr,
    a_log_ptr,
    bias_ptr,
    out_ptr,
    HK,
    K,
    stride_f,
    lower_bound,
    BOUNDED: tl.constexpr,
    B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * B + tl.arange(0, B)  # [B] over H * K
    mask = cols < HK
    x = tl.load(f_ptr + row * stride_f + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + cols // K, mask=mask, other=0.0).to(tl.float32))  # per head
    if BOUNDED:
        g = lower_bound * tl.sigmoid(a * x)
    else:  # softplus as torch computes it: x itself past 20
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(out_ptr + row * HK + cols, g, mask=mask)


def kda_gate_triton(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """f [..., H, K] -> g [..., H, K] fp32; A_log with H elements, dt_bias [H * K]."""
    H, K = f.shape[-2:]
    assert A_log.numel() == H and dt_bias.numel() == H * K, (
        f"A_log {A_log.numel()}, dt_bias {dt_bias.numel()}"
    )
    rows = as_rows(f, H * K)
    out = torch.empty(rows.shape, dtype=torch.float32, device=f.device)
    if rows.shape[0]:
        B = min(1024, triton.next_power_of_2(H * K))
        grid = (rows.shape[0], triton.cdiv(H * K, B))
        _gate_kernel[grid](
            rows,
            A_log.reshape(-1),
            dt_bias.reshape(-1),
            out,
            H * K,
            K,
            rows.stride(0),
            float(lower_bound if lower_bound is not None else 0.0),
            BOUNDED=lower_bound is not None,
            B=B,
            **pdl_args(out),
        )
    return out.view(f.shape)
