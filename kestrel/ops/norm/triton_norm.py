"""RMSNorm in one Triton kernel: `naive.rms_norm` (fp32 math, result in the input dtype) for inference on CUDA.

Eager PyTorch runs the reference as about eight kernels (upcast, square, mean, rsqrt, two products, two casts);
decode is bound by kernel count, so one row-wise kernel replaces them. Legend: N rows, D the normalized width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * (x * inv)).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (rows may be strided; the last dim contiguous), weight [D] -> [..., D] in x.dtype."""
    D = x.shape[-1]
    assert weight.shape == (D,), f"weight {tuple(weight.shape)} for width {D}"
    rows = x if x.dim() == 2 else x.reshape(-1, D)  # a view when x is contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [N, D]
    if rows.shape[0]:
        BD = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            out,
            D,
            rows.stride(0),
            out.stride(0),
            float(eps),
            BD=BD,
            num_warps=min(16, max(1, BD // 256)),
        )
    return out.view(x.shape)
