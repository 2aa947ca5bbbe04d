"""The GLU activations in one Triton kernel each: `naive.swiglu` and `naive.situ` (fp32 math, result in the gate's
dtype) for inference on CUDA, reading the gate and up halves in place (strided views of one [.., 2I] output).

Legend: N rows, I the activation width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.norm.triton_norm import as_rows
from kestrel.ops.pdl import pdl_args, pdl_begin

BLOCK = 1024  # columns per program


@triton.jit
def tanh(z):
    """tanh in fp32 (Triton has no tanh of its own, the interpreter no libdevice): a series near 0, where
    1 - exp(-2|z|) would cancel; exp(-2|z|) never overflows."""
    a = tl.abs(z)
    t = tl.exp(-2.0 * a)
    far = (1.0 - t) / (1.0 + t)
    a2 = a * a
    near = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))  # error < 3e-11 relative
    r = tl.where(a < 0.1, near, far)
    return tl.where(z < 0, -r, r)


@triton.jit
def glu(a, b, beta, linear_beta, SITU: tl.constexpr):
    """The gated activation of fp32 gate a and up b: SiTU (`naive.situ`) or SwiGLU (`naive.swiglu`)."""
    if SITU:
        return beta * tanh(a / beta) * tl.sigmoid(a) * (linear_beta * tanh(b / linear_beta))
    return a * tl.sigmoid(a) * b


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
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    mask = cols < I
    a = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = glu(a, b, beta, linear_beta, SITU)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _glu(gate: torch.Tensor, up: torch.Tensor, situ: bool, beta: float, linear_beta: float) -> torch.Tensor:
    assert gate.shape == up.shape, f"gate {tuple(gate.shape)} vs up {tuple(up.shape)}"
    g, u = as_rows(gate), as_rows(up)
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
            **pdl_args(out),
        )
    return out.view(gate.shape)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _glu(gate, up, False, 1.0, 1.0)


def situ_triton(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return _glu(gate, up, True, beta, linear_beta)


@triton.jit
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, n, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    s = tl.sigmoid(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)  # rounded as torch
    y = x.to(tl.float32) * s.to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate_triton(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`naive.sigmoid_gate` in one pass (one read of x and of the gate, one write), where eager torch casts the
    gate to fp32, takes its sigmoid, casts it back and multiplies: four passes over [T, H * Dv]."""
    assert gate.numel() == x.numel(), f"gate {tuple(gate.shape)} vs x {tuple(x.shape)}"
    x, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _sigmoid_gate_kernel[(triton.cdiv(n, 4096),)](
            x, gate, out, n, BLOCK_N=4096, num_warps=8, **pdl_args(out)
        )
    return out
