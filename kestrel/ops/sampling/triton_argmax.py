"""Each row's argmax of logits [B, V] in two Triton kernels: `naive.greedy` (torch.argmax) exactly, for the
greedy tokens the decode graphs hand the sampler (kestrel.engine.runner).

Legend: B rows, V vocabulary, C chunks of BV a row.

The first kernel's program (b, c) finds chunk c's best of row b, the second's program b the best of its row's C
chunks, each by one max over int64s: a value's int32 key (ordered as the floats are, with torch's rules: -0.0
equal to +0.0, NaN above everything) above its column reversed (the first maximum wins ties).

On the H200 (session 40, scripts/decode_kernels_check.py --sections argmax, mini's 129,280-token vocabulary, bf16
logits, one call a graph replay), us at batch 1 / 64 / 256: **6.6 / 14.9 / 34.4** against torch.argmax's 41.0 /
42.8 / 53.3 in the same run (the bytes at the copy rate: 0.06 / 3.9 / 15.6). A max and an argmax a chunk (two
reductions, not one) took 7.1 / 15.8 / 39.7 (call 5).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_begin

# a chunk's width: 2048 (64 a row of mini's 129K vocabulary, 16 values a thread of 4 warps) up to BV_WIDE_FROM rows,
# else 8192 (fewer, longer programs: 34.4 against 39.4 us at 256 rows, session 40). Session 41 swept widths 2048-16384 x
# 4 / 8 / 16 warps at 64 and 256 rows: nothing beat these (256 rows: 34.3 us, the best other 34.6; the bytes 15.6)
BV, BV_WIDE, BV_WIDE_FROM = 2048, 8192, 128


@triton.jit
def _key(x):
    """fp32 values -> int32 keys in the same order: the sign bit flips the magnitude's order; -0.0 is
    +0.0's key, NaN the largest. Not the DSA top-k's uint32 `_sort_key` with NaN raised after it: that form
    took 19.6 / 49.6 us at batch 64 / 256 against this one's 15.0 / 34.5, in one call (session 41)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _packed(v, cols, live):
    """fp32 values v at columns cols -> int64 keys, one max away from the best: the value's key above 2**31 - 1 -
    its column (the first column among equals wins); the lowest int64 where not live. `_column` undoes it."""
    packed = _key(v).to(tl.int64) * 4294967296 + (2147483647 - cols).to(tl.int64)
    return tl.where(live, packed, -9223372036854775807 - 1)


@triton.jit
def _column(packed):
    """The column a `_packed` key was made at."""
    return 2147483647 - (packed & 4294967295)


@triton.jit
def _chunk_kernel(x, best, V, C, stride, BV: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, c): the best of row b's chunk c, as one int64 (`_packed`)."""
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BV + tl.arange(0, BV)
    v = tl.load(x + b * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
    tl.store(best + b * C + c, tl.max(_packed(v, cols, cols < V), axis=0))


@triton.jit
def _rows_kernel(best, out, C, BC: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: the best of row b's C chunk bests, its column out of the low word."""
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, BC)
    packed = tl.max(tl.load(best + b * C + cs, mask=cs < C, other=-9223372036854775807 - 1), axis=0)
    tl.store(out + b, _column(packed))


def argmax_triton(x: torch.Tensor, block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [B, V] (fp32, bf16 or fp16; rows contiguous) -> [B] int64, torch.argmax(x, -1). block: a chunk's width
    (a power of two; None: BV, or BV_WIDE from BV_WIDE_FROM rows); num_warps: the chunk kernel's."""
    assert x.dim() == 2 and x.stride(-1) == 1, (
        f"logits {tuple(x.shape)} with stride {x.stride()}: rows [B, V]"
    )
    B, V = x.shape
    assert V > 0, "argmax of empty rows"
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    block = block or (BV if B < BV_WIDE_FROM else BV_WIDE)
    C = triton.cdiv(V, block)
    best = torch.empty(B, C, dtype=torch.int64, device=x.device)
    pdl = pdl_args(out)
    _chunk_kernel[(B, C)](x, best, V, C, x.stride(0), BV=block, num_warps=num_warps, **pdl)
    _rows_kernel[(B,)](best, out, C, BC=triton.next_power_of_2(C), num_warps=1, **pdl)
    return out
