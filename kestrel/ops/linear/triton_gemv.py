"""y = x W^T for a few rows (decode's projections) in Triton: `naive.linear_reference`'s result up to the
order of the fp32 sums.

Legend: M rows of x (at most 16), N output features, K input features; BN weight rows a program, BK a step.
Program n owns the output columns n * BN .. n * BN + BN - 1 for every row: it streams its [BN, K] slice of W
(contiguous in memory) once, in BK-wide tiles, each multiplied against x's [M, BK] tile (tl.dot, M padded to
16, fp32 accumulation), and writes [M, BN] rounded once. With PDL (kestrel.ops.pdl) the program first lets
the next kernel launch, then asks for its whole weight slice into L2 (one bulk prefetch a row), and only then
waits for the kernel before it: weights do not depend on it, so they stream in while it ends, and the loop
reads them from L2.

Where it runs: `kestrel.ops.linear.linear`, from every `Linear` layer at inference up to GEMV_MAX_ROWS rows
where PDL is on (`gemv_applies`). cuBLAS's kernels for one row read mini's projections at a fraction of the
copy rate (84 calls of ~5 us at batch 1 in session 19's profile, for 0.30 ms of weights at the copy rate) and
cannot launch with PDL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import l2_prefetch, pdl_args, pdl_launch_next, pdl_wait


@triton.jit
def _gemv_kernel(
    x, w, out, M, N, K, stride_xm, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)  # [BN] output features = weight rows
    nmask = cols < N
    w_rows = w + cols[:, None].to(tl.int64) * K  # [BN, 1]
    pdl_launch_next(PDL)
    if PREFETCH:  # this slice's rows (PREFETCH bytes each) into L2 before the wait: no kernel writes weights
        l2_prefetch(w + tl.minimum(cols, N - 1).to(tl.int64) * K, PREFETCH)
    pdl_wait(PDL)
    m = tl.arange(0, BM)
    mmask = m < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        xt = tl.load(
            x + m[:, None] * stride_xm + ks[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
        )
        wt = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)  # [BN, BK]
        if DOT_F32:
            xt, wt = xt.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc=acc, input_precision=PRECISION)  # [BM, BN]
    tl.store(
        out + m[:, None] * stride_om + cols[None, :],
        acc.to(out.dtype.element_ty),
        mask=mmask[:, None] & nmask[None, :],
    )


# Launch knobs from a sweep on the H200 (session 23, 2026-12-01; its configurations and times are in
# bench/results/2026-12-01-h200-session23.json): mini's projections after an RMSNorm, 24 layers' weights in one
# CUDA graph, block_n 16 / 32 / 64 x block_k 128 / 256 x 2-4 stages x prefetch on / off. 64 weight rows a program
# (32 below 2048 outputs: more programs), 256-wide steps, 4 stages; the L2 prefetch paid up to 8 MB of weights
# (2048 x 1024 at batch 1: 4.6 against 5.4 us without) and cost above (3072 x 2048 at batch 1: 8.5 against 7.8).
PREFETCH_MAX_BYTES = 8 << 20


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    prefetch: bool | None = None,
) -> torch.Tensor:
    """x [..., K] (at most 16 rows), weight [N, K] contiguous -> [..., N] in x.dtype, fp32 sums. block_n None:
    64 from 2048 outputs up, else 32; prefetch (the weight slice into L2 before the PDL wait, where PDL is on)
    None: up to PREFETCH_MAX_BYTES of weights."""
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape == (N, K) and weight.is_contiguous(), f"weight {tuple(weight.shape)} for width {K}"
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    assert M <= 16, f"{M} rows: the GEMV takes at most 16"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        pdl = pdl_args(out)
        row_bytes = K * weight.element_size()
        block_n = block_n or (64 if N >= 2048 else 32)
        prefetch = prefetch if prefetch is not None else N * row_bytes <= PREFETCH_MAX_BYTES
        dot_f32 = x.dtype == torch.float32 or not x.is_cuda  # the CPU interpreter's tl.dot misreads bf16
        _gemv_kernel[(triton.cdiv(N, block_n),)](
            rows, weight, out, M, N, K, rows.stride(0), out.stride(0),
            BM=16, BN=block_n, BK=min(block_k, max(16, triton.next_power_of_2(K))), DOT_F32=dot_f32,
            PRECISION="ieee" if dot_f32 else "tf32",
            PREFETCH=row_bytes if prefetch and pdl and row_bytes % 16 == 0 and weight.data_ptr() % 16 == 0 else 0,
            num_warps=num_warps, num_stages=num_stages, **pdl,
        )  # fmt: skip
    return out.view(*x.shape[:-1], N)
