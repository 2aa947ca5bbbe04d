"""The rows' argmax in Triton (kestrel.ops.sampling.triton_argmax) against torch.argmax (`naive.greedy`): the
same index on random rows, widths that do not divide the chunks, ties within and across chunks, -0.0 beside
+0.0, -inf rows, NaN, bf16. Without CUDA the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.sampling.naive import greedy

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x: torch.Tensor):
    from kestrel.ops.sampling import triton_argmax

    got = triton_argmax.argmax_triton(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    assert torch.equal(got.cpu(), greedy(x.float().cpu())), (got, greedy(x.float().cpu()))


@pytest.mark.parametrize("B,V", [(1, 1), (1, 2047), (3, 2049), (2, 5000), (4, 129280)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows(B, V, dtype):
    g = torch.Generator().manual_seed(B * V)
    _check(torch.randn(B, V, generator=g).to(DEVICE, dtype))


def test_ties_signed_zeros_infinities_and_nan():
    """Ties go to the first column, also across chunks (2048 wide) and where a later chunk holds an equal
    maximum; -0.0 equals +0.0; an all -inf row gives 0; NaN wins, the first one."""
    V = 5000
    x = torch.full((7, V), -3.0)
    x[0, [10, 2100, 4999]] = 2.0  # equal maxima in three chunks
    x[1, [4096, 4097]] = 1.5  # a tie inside the last chunk
    x[2] = -1.0
    x[2, 3000], x[2, 100] = 0.0, -0.0  # -0.0 first: torch treats them as equal
    x[3] = float("-inf")
    x[4, 1234], x[4, 3333], x[4, 10] = float("nan"), float("nan"), float("inf")
    x[5, -1] = float("inf")
    x[6, 2047], x[6, 2048] = 7.0, 7.0  # the chunk boundary
    _check(x.to(DEVICE))
    if DEVICE == "cuda":
        _check(x.to(DEVICE, torch.bfloat16))


def test_dispatch_and_bad_input():
    from kestrel.ops.sampling import argmax

    x = torch.randn(3, 100, device=DEVICE)
    assert torch.equal(argmax(x), torch.argmax(x, -1))
    assert torch.equal(argmax(x[:, ::2]), torch.argmax(x[:, ::2], -1))  # strided rows: torch
    from kestrel.ops.sampling.triton_argmax import argmax_triton

    with pytest.raises(AssertionError, match="rows"):
        argmax_triton(x[:, ::2])
    assert argmax_triton(x[:0]).shape == (0,)


@pytest.mark.parametrize("block", [1024, 4096, 8192])
def test_other_chunk_widths(block):
    """The chunk width is a knob (the sweep in scripts/decode_kernels_check.py): every width gives torch's
    index, on ties across chunks too."""
    from kestrel.ops.sampling.triton_argmax import argmax_triton

    x = torch.randn(3, 9000, generator=torch.Generator().manual_seed(block))
    x[1, [5, 1100, 8999]] = 9.0
    assert torch.equal(argmax_triton(x.to(DEVICE), block).cpu(), greedy(x))


def test_wide_chunks_from_many_rows():
    """From BV_WIDE_FROM rows the default chunk is BV_WIDE wide: still torch's index on every row."""
    from kestrel.ops.sampling.triton_argmax import BV_WIDE_FROM, argmax_triton

    x = torch.randn(BV_WIDE_FROM, 9000, generator=torch.Generator().manual_seed(1))
    x[:, 8999] = x[:, 3] = 50.0
    assert torch.equal(argmax_triton(x.to(DEVICE)).cpu(), torch.full((BV_WIDE_FROM,), 3))
