"""The GLU activations in one Triton kernel each: `naive.swiglu` and `naive.situ` (fp32 math, result in the gate's
dtype) for inference on CUDA, reading the gate and up halves in place (strided views of one [.., 2I] output).

Legend: N rows, I the activation width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _tanh(x):
    """tanh from exp (Triton has no tanh of its own): a Taylor series near 0, where 1 - 2 / (e^2x + 1) cancels."""
    big = 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * x, 60.0)) + 1.0)  # tanh(30) is 1 in fp32: no overflow
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, small, big)


@triton.jit
def _glu_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    I,
    stride_g,
    stride_u,
    stride_o,
    beta,
    linear_beta,
    SITU: tl.constexpr,
    BI: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = cols < I
    a = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if SITU:
        y = beta * _tanh(a / beta) * tl.sigmoid(a) * (linear_beta * _tanh(b / linear_beta))
    else:
        y = a * tl.sigmoid(a) * b
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _glu(gate: torch.Tensor, up: torch.Tensor, situ: bool, beta: float, linear_beta: float) -> torch.Tensor:
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)} vs up {tuple(up.shape)}"
    g, u = _rows(gate), _rows(up)
    N, I = g.shape
    out = torch.empty(N, I, dtype=gate.dtype, device=gate.device)  # [N, I]
    if N and I:
        BI = min(BLOCK, triton.next_power_of_2(I))
        grid = (N, triton.cdiv(I, BI))
        _glu_kernel[grid](
            g,
            u,
            out,
            I,
            g.stride(0),
            u.stride(0),
            out.stride(0),
            float(beta),
            float(linear_beta),
            SITU=situ,
            BI=BI,
        )
    return out.view(gate.shape)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _glu(gate, up, False, 1.0, 1.0)


def situ_triton(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return _glu(gate, up, True, beta, linear_beta)
