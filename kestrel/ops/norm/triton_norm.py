"""RMSNorm in one Triton kernel: `naive.rms_norm` (fp32 math, result in the input dtype) for inference on CUDA,
and KDA's output norm-gate (`kda.naive.gated_rms_norm`: the same times sigmoid(gate)); LayerNorm likewise
(`naive.layer_norm`, the DSA indexer's key norm: an upcast of x, of the weight and of the bias, the norm and a
downcast, five kernels a layer in eager PyTorch, one here).

Eager PyTorch runs the reference as about eight kernels (upcast, square, mean, rsqrt, two products, two casts);
decode is bound by kernel count, so one row-wise kernel replaces them. Legend: N rows, D the normalized width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    g_ptr,
    out_ptr,
    D,
    x_units,
    G_HEADS,
    g_units,
    stride_o,
    eps,
    X_ALIGN: tl.constexpr,
    G_ALIGN: tl.constexpr,
    GATE: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    stride_x, stride_g = x_units * X_ALIGN, g_units * G_ALIGN  # known multiples: rows load as vectors
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * (x * inv)
    if GATE:
        # gate row `row` at (row // G_HEADS) * stride_g + (row % G_HEADS) * D: G_HEADS rows of D per token
        g_row = (row // G_HEADS) * stride_g + (row % G_HEADS) * D
        y = y * tl.sigmoid(tl.load(g_ptr + g_row + cols, mask=mask, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    D,
    x_units,
    stride_o,
    eps,
    X_ALIGN: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    stride_x = x_units * X_ALIGN  # a known multiple: rows load as vectors
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
    centered = tl.where(mask, x - tl.sum(x, axis=0) / D, 0.0)
    inv = tl.rsqrt(tl.sum(centered * centered, axis=0) / D + eps)  # the biased variance, as torch's
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (centered * inv * w + b).to(out_ptr.dtype.element_ty), mask=mask
    )


def as_rows(t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """t as [N, width] rows (default width: its last dim) with a contiguous last dim, a view when it can be:
    the layout of the row-wise kernels here and in ops/activation, ops/kda."""
    width = width or t.shape[-1]
    rows = t if t.dim() == 2 and t.shape[1] == width else t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def row_align(stride: int) -> int:
    """The largest of 16, 8, 4, 2, 1 elements dividing a row stride. Triton only knows an integer argument
    divides by 16 when it does: a row stride of 4232 (a column slice of mini's merged KDA input projection) would
    load element by element. Passed as stride / align and multiplied back by align as a constexpr inside, it
    tells the compiler the rows start 16 bytes apart (8 bf16) and lets it load vectors."""
    return next(a for a in (16, 8, 4, 2, 1) if stride % a == 0)


def _gate_rows(gate: torch.Tensor, D: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, heads, token stride) such that gate row r is at (r // heads) * stride + (r % heads) * D. A
    [T, H, D] gate whose heads lie contiguous within each token (a column slice of a wider matmul's output)
    is read in place; any other layout goes through `as_rows`."""
    if gate.dim() == 3 and gate.stride(2) == 1 and gate.stride(1) == D:
        return gate, gate.shape[1], gate.stride(0)
    rows = as_rows(gate)
    return rows, 1, rows.stride(0)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None) -> torch.Tensor:
    D = x.shape[-1]
    assert weight.shape == (D,), f"weight {tuple(weight.shape)} for width {D}"
    rows = as_rows(x)
    g, heads, stride_g = _gate_rows(gate, D) if gate is not None else (rows, 1, rows.stride(0))
    assert gate is None or gate.shape == x.shape, f"gate {tuple(gate.shape)} vs x {tuple(x.shape)}"
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [N, D]
    if rows.shape[0]:
        BD = triton.next_power_of_2(D)
        x_align, g_align = row_align(rows.stride(0)), row_align(stride_g)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight,
            g,
            out,
            D,
            rows.stride(0) // x_align,
            heads,
            stride_g // g_align,
            out.stride(0),
            float(eps),
            X_ALIGN=x_align,
            G_ALIGN=g_align,
            GATE=gate is not None,
            BD=BD,
            num_warps=min(16, max(1, BD // 256)),
            **pdl_args(out),
        )
    return out.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (rows may be strided; the last dim contiguous), weight [D] -> [..., D] in x.dtype."""
    return _norm(x, weight, eps, None)


def gated_rms_norm_triton(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm_weight(o) * sigmoid(gate); o, gate [..., V], weight [V] -> [..., V] in o.dtype."""
    return _norm(o, weight, eps, gate)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """`naive.layer_norm`: x [..., D] (rows may be strided; the last dim contiguous), weight and bias [D] ->
    [..., D] in x.dtype, fp32 math (the mean and variance in two passes over the row, torch's a running form:
    equal up to fp32 rounding)."""
    D = x.shape[-1]
    assert weight.shape == bias.shape == (D,), (
        f"weight {tuple(weight.shape)}, bias {tuple(bias.shape)}, D {D}"
    )
    rows = as_rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [N, D]
    if rows.shape[0]:
        BD = triton.next_power_of_2(D)
        x_align = row_align(rows.stride(0))
        _layer_norm_kernel[(rows.shape[0],)](
            rows, weight, bias, out, D, rows.stride(0) // x_align, out.stride(0), float(eps), X_ALIGN=x_align,
            BD=BD, num_warps=min(16, max(1, BD // 256)), **pdl_args(out),
        )  # fmt: skip
    return out.view(x.shape)
