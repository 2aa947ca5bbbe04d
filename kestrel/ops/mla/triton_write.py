"""`naive.write_rows` in one Triton kernel: the latent cache write of a step's new tokens, c_kv and k_pe stored
side by side into their pool rows, and the indexer keys into theirs, in one launch. Decode ran it as a
concatenation and two indexed copies, three launches per MLA layer (on the H200 at batch 256 on `mini`: 55 us a
step in 18 launches, session 25's eager profile). At decode it also applies c_kv's RMSNorm and the indexer key's
LayerNorm as it stores each row (two launches a MLA layer fewer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.mla.naive import write_rows
from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def _write_rows_kernel(
    rows, a, b, pool, keys, index_pool, A, B, DI, stride_a, stride_b, stride_pool, stride_keys, stride_index,
    a_weight, a_eps, k_weight, k_bias, k_eps,
    BA: tl.constexpr, BB: tl.constexpr, BI: tl.constexpr, INDEX: tl.constexpr, NORM_A: tl.constexpr = False,
    NORM_K: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program t: pool[rows[t], :A] = a[t], pool[rows[t], A:A + B] = b[t]; with INDEX, index_pool[rows[t]] = keys[t].
    NORM_A: a[t] RMS-normed first (`rms_norm`: fp32, times a_weight); NORM_K: keys[t] layer-normed first
    (`layer_norm`: fp32, two passes, times k_weight plus k_bias)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows + t).to(tl.int64)
    ca = tl.arange(0, BA)
    va = tl.load(a + t * stride_a + ca, mask=ca < A, other=0.0)
    if NORM_A:
        x = va.to(tl.float32)
        x = x * tl.rsqrt(tl.sum(x * x, 0) / A + a_eps)
        va = tl.load(a_weight + ca, mask=ca < A, other=0.0).to(tl.float32) * x
    tl.store(pool + row * stride_pool + ca, va.to(pool.dtype.element_ty), mask=ca < A)
    cb = tl.arange(0, BB)
    vb = tl.load(b + t * stride_b + cb, mask=cb < B)
    tl.store(pool + row * stride_pool + A + cb, vb, mask=cb < B)
    if INDEX:
        ci = tl.arange(0, BI)
        vi = tl.load(keys + t * stride_keys + ci, mask=ci < DI, other=0.0)
        if NORM_K:
            x = vi.to(tl.float32)
            d = tl.where(ci < DI, x - tl.sum(x, 0) / DI, 0.0)
            x = d * tl.rsqrt(tl.sum(d * d, 0) / DI + k_eps)
            w = tl.load(k_weight + ci, mask=ci < DI, other=0.0).to(tl.float32)
            vi = x * w + tl.load(k_bias + ci, mask=ci < DI, other=0.0).to(tl.float32)
        tl.store(index_pool + row * stride_index + ci, vi.to(index_pool.dtype.element_ty), mask=ci < DI)


def write_rows_triton(
    pool: torch.Tensor,
    rows: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    index_pool: torch.Tensor | None = None,
    index_keys: torch.Tensor | None = None,
    kv_norm: tuple | None = None,
    index_norm: tuple | None = None,
) -> None:
    """`naive.write_rows`, same arguments and effect (the norms in the kernel, each row normed as it is stored):
    two parts of [T, *] in the pool's dtype with unit column stride (rows may be strided, as k_pe's slice of the
    projection), pools with unit column stride; anything else (a cast, more parts) goes to the reference. Rows
    are distinct but for a decode graph's padding rows, which all write the dummy page's row 0: one of their
    writes lands there, as with the reference's indexed copy."""
    fits = len(parts) == 2 and all(p.dim() == 2 and p.stride(1) == 1 and p.dtype == pool.dtype for p in parts)
    fits = fits and pool.dim() == 2 and pool.stride(1) == 1 and rows.dim() == 1
    has_index = index_pool is not None
    if has_index:
        fits = fits and index_keys.dim() == 2 and index_keys.stride(1) == 1 and index_pool.stride(1) == 1
        fits = fits and index_keys.dtype == index_pool.dtype
    fits = fits and (index_norm is None or has_index)
    if not fits:
        return write_rows.eager(pool, rows, parts, index_pool, index_keys, kv_norm, index_norm)
    a, b = parts
    T, A = a.shape
    B = b.shape[1]
    assert b.shape[0] == T == rows.shape[0] and A + B == pool.shape[1], "parts, rows and pool disagree"
    keys, index = (index_keys, index_pool) if has_index else (a, pool)  # unused without INDEX
    assert not has_index or (keys.shape == (T, index.shape[1])), "index keys and index pool disagree"
    a_weight, a_eps = kv_norm if kv_norm is not None else (a, 0.0)  # placeholders, never read
    k_weight, k_bias, k_eps = index_norm if index_norm is not None else (a, a, 0.0)
    if T:
        _write_rows_kernel[(T,)](
            rows, a, b, pool, keys, index, A, B, index.shape[1], a.stride(0), b.stride(0), pool.stride(0),
            keys.stride(0), index.stride(0), a_weight, float(a_eps), k_weight, k_bias, float(k_eps),
            BA=triton.next_power_of_2(A), BB=triton.next_power_of_2(B), BI=triton.next_power_of_2(index.shape[1]),
            INDEX=has_index, NORM_A=kv_norm is not None, NORM_K=index_norm is not None, **pdl_args(pool),
        )  # fmt: skip
