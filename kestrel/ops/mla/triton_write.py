"""`naive.write_rows` in one Triton kernel: the latent cache write of a step's new tokens, c_kv and k_pe stored
side by side into their pool rows, and the indexer keys into theirs, in one launch. Decode ran it as a
concatenation and two indexed copies, three launches per MLA layer (on the H200 at batch 256 on `mini`: 55 us a
step in 18 launches, session 25's eager profile)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.mla.naive import write_rows
from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def _write_rows_kernel(
    rows, a, b, pool, keys, index_pool, A, B, DI, stride_a, stride_b, stride_pool, stride_keys, stride_index,
    BA: tl.constexpr, BB: tl.constexpr, BI: tl.constexpr, INDEX: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program t: pool[rows[t], :A] = a[t], pool[rows[t], A:A + B] = b[t]; with INDEX, index_pool[rows[t]] = keys[t]."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows + t).to(tl.int64)
    ca = tl.arange(0, BA)
    va = tl.load(a + t * stride_a + ca, mask=ca < A)
    tl.store(pool + row * stride_pool + ca, va, mask=ca < A)
    cb = tl.arange(0, BB)
    vb = tl.load(b + t * stride_b + cb, mask=cb < B)
    tl.store(pool + row * stride_pool + A + cb, vb, mask=cb < B)
    if INDEX:
        ci = tl.arange(0, BI)
        vi = tl.load(keys + t * stride_keys + ci, mask=ci < DI)
        tl.store(index_pool + row * stride_index + ci, vi, mask=ci < DI)


def write_rows_triton(
    pool: torch.Tensor,
    rows: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    index_pool: torch.Tensor | None = None,
    index_keys: torch.Tensor | None = None,
) -> None:
    """`naive.write_rows`, same arguments and effect: two parts of [T, *] in the pool's dtype with unit column
    stride (rows may be strided, as k_pe's slice of the projection), pools with unit column stride; anything
    else (a cast, more parts) goes to the reference. Rows are distinct but for a decode graph's padding rows, which
    all write the dummy page's row 0: one of their writes lands there, as with the reference's indexed copy."""
    fits = len(parts) == 2 and all(p.dim() == 2 and p.stride(1) == 1 and p.dtype == pool.dtype for p in parts)
    fits = fits and pool.dim() == 2 and pool.stride(1) == 1 and rows.dim() == 1
    has_index = index_pool is not None
    if has_index:
        fits = fits and index_keys.dim() == 2 and index_keys.stride(1) == 1 and index_pool.stride(1) == 1
        fits = fits and index_keys.dtype == index_pool.dtype
    if not fits:
        return write_rows.eager(pool, rows, parts, index_pool, index_keys)
    a, b = parts
    T, A = a.shape
    B = b.shape[1]
    assert b.shape[0] == T == rows.shape[0] and A + B == pool.shape[1], "parts, rows and pool disagree"
    keys, index = (index_keys, index_pool) if has_index else (a, pool)  # unused without INDEX
    assert not has_index or (keys.shape == (T, index.shape[1])), "index keys and index pool disagree"
    if T:
        _write_rows_kernel[(T,)](
            rows, a, b, pool, keys, index, A, B, index.shape[1], a.stride(0), b.stride(0), pool.stride(0),
            keys.stride(0), index.stride(0), BA=triton.next_power_of_2(A), BB=triton.next_power_of_2(B),
            BI=triton.next_power_of_2(index.shape[1]), INDEX=has_index, **pdl_args(pool),
        )  # fmt: skip
