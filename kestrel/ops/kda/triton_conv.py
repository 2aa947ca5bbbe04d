"""The KDA short-conv decode step on the state slots themselves (CUDA-graph safe, no gather/scatter copies).

Legend: N sequences (one new token each), C channels (q|k|v), W conv width, S pool slots.
Reference: `naive.short_conv_step` on the gathered windows, then the windows scattered back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    x, weight, pool, slots, y, N, C, PC, stride_xn, stride_ps, stride_pc, W: tl.constexpr, BC: tl.constexpr
):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    cols = i_c * BC + tl.arange(0, BC)  # [BC]
    mask = cols < C
    slot = tl.load(slots + i_n).to(tl.int64)
    base = pool + slot * stride_ps + cols * stride_pc  # the window of this sequence's channels
    x_new = tl.load(x + i_n * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)  # [BC]
    acc = x_new * tl.load(weight + cols * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):  # window position j holds the input of W-1-j steps ago
        h = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
        acc += h * tl.load(weight + cols * W + j, mask=mask, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)  # SiLU
    # y is planes [C // PC, N, PC]: channel c of sequence n at (c // PC, n, c % PC)
    tl.store(y + (cols // PC) * N * PC + i_n * PC + cols % PC, out.to(y.dtype.element_ty), mask=mask)
    for j in tl.static_range(W - 2):  # shift the window left by one, then append the new input
        h = tl.load(base + j + 1, mask=mask, other=0.0)
        tl.store(base + j, h, mask=mask)
    if W > 1:
        tl.store(base + (W - 2), x_new.to(pool.dtype.element_ty), mask=mask)


def conv_step_inplace(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    planes: int = 1,
    block: int = 256,
) -> torch.Tensor:
    """y = SiLU(conv over [window | x]); each slot's window [C, W-1] in conv_pool [S, C, W-1] advances in
    place. x [N, C] (rows may be strided: a column slice of a wider matmul), weight [C, W] contiguous,
    slots [N] (distinct, or the dummy slot 0). y is [N, C], or with planes > 1 [planes, N, C / planes]: the
    channel groups (q | k | v) each contiguous, so that the recurrence reads them without copies."""
    N, C = x.shape
    W = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_pool.stride(2) == 1 and C % planes == 0
    y = x.new_empty(planes, N, C // planes)
    grid = (N, triton.cdiv(C, block))
    _conv_step_kernel[grid](
        x,
        weight,
        conv_pool,
        slots,
        y,
        N,
        C,
        C // planes,
        x.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        W=W,
        BC=block,
    )
    return y if planes > 1 else y[0]
