"""Sparse training's narrowing of rows of a visibility mask to their DSA selection, in Triton:
`keep_selected_triton(mask, picks, indices)` does what `naive.keep_selected_` does, in one pass over each picked
row instead of the reference's [M, L] gather, [M, L + 1] scatter, AND and [M, L] write back.

Legend: N rows and L columns of the mask, M picked rows, k = index_topk.

One program a picked row: it reads the row's bits at its k selected positions, clears the row, and writes those
bits back; the CTA barriers between these three phases order one program's reads and writes of the same bytes
across its threads. Picked rows must be distinct (two programs would race on one row; the sparse selection picks each
query once). Bytes a row: L written, k x 9 read, k written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.dsa.naive import check_selection

MAX_K = 16384  # the selection held in registers: one program's BK indices and bits


@triton.jit
def _keep_selected_kernel(
    mask_ptr, picks_ptr, idx_ptr, L, K, stride_mask, stride_idx, BK: tl.constexpr, BL: tl.constexpr
):
    m = tl.program_id(0)
    row = mask_ptr + tl.load(picks_ptr + m).to(tl.int64) * stride_mask
    kk = tl.arange(0, BK)
    ix = tl.load(idx_ptr + m.to(tl.int64) * stride_idx + kk, mask=kk < K, other=-1)  # [BK], -1 = unused
    ok = (ix >= 0) & (ix < L)
    kept = tl.load(row + ix, mask=ok, other=0)  # [BK] the row's bits at its selection
    tl.debug_barrier()
    for c in range(0, L, BL):
        cols = c + tl.arange(0, BL)
        tl.store(row + cols, tl.zeros([BL], dtype=tl.uint8), mask=cols < L)
    tl.debug_barrier()
    tl.store(row + ix, kept, mask=ok)


def keep_selected_triton(mask: torch.Tensor, picks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`naive.keep_selected_`: mask [N, L] bool (rows may be strided, columns contiguous), picks [M] distinct
    row numbers, indices [M, k] (-1 = unused; a position outside [-1, L) is a device-side assert, as in
    `naive.check_selection`). In place; returns mask."""
    N, L = mask.shape
    M, K = indices.shape
    assert mask.dtype == torch.bool and mask.stride(1) == 1, f"mask {mask.dtype}, strides {mask.stride()}"
    assert picks.shape == (M,) and K <= MAX_K, f"picks {tuple(picks.shape)}, indices {tuple(indices.shape)}"
    check_selection(indices, L)
    if M == 0:
        return mask
    indices = indices if indices.stride(1) == 1 else indices.contiguous()
    _keep_selected_kernel[(M,)](
        mask.view(torch.uint8), picks, indices, L, K, mask.stride(0), indices.stride(0),
        BK=max(16, triton.next_power_of_2(K)), BL=1024, num_warps=4,
    )  # fmt: skip
    return mask
