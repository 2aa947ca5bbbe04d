"""The Triton GEMV (kestrel.ops.linear.triton_gemv) against F.linear, and where `linear` picks it. Without CUDA
the kernel runs under TRITON_INTERPRET=1 (fp32 operands); with CUDA in bf16, PDL and the weight prefetch on
Hopper. Outputs are fresh tensors: a column the kernel never writes fails the comparison."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: before the first import
triton = pytest.importorskip("triton")

from kestrel.ops import linear as linear_ops  # noqa: E402

if "kestrel.ops.linear.triton_gemv" in sys.modules:  # decorated in the mode chosen above
    importlib.reload(sys.modules["kestrel.ops.linear.triton_gemv"])
from kestrel.ops.linear.triton_gemv import gemv_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _close(got, want):
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item()
    )


@pytest.mark.parametrize("M,N,K", [(1, 17, 100), (3, 40, 300), (16, 1, 8), (5, 33, 520)])
def test_gemv_matches_linear(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, DTYPE)
    w = torch.randn(N, K, generator=g).to(DEVICE, DTYPE)
    _close(gemv_triton(x, w), F.linear(x, w))


def test_gemv_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 2 * 64, generator=g).to(DEVICE, DTYPE)[..., :64]  # rows 128 apart
    w = torch.randn(48, 64, generator=g).to(DEVICE, DTYPE)
    got = gemv_triton(x, w)
    assert got.shape == (2, 3, 48)
    _close(got, F.linear(x, w))


def test_linear_picks_the_gemv_only_where_it_applies(monkeypatch):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert not linear_ops.gemv_applies(x, w)  # the CPU: F.linear
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert linear_ops.gemv_applies(xc, wc)
        assert not linear_ops.gemv_applies(torch.zeros(17, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not linear_ops.gemv_applies(xc.float(), wc.float())
        assert not linear_ops.gemv_applies(xc, wc.requires_grad_())  # autograd records: cuBLAS
        with torch.no_grad():
            assert linear_ops.gemv_applies(xc, wc)
        monkeypatch.setenv("KESTREL_GEMV", "off")
        assert not linear_ops.gemv_applies(xc, wc.detach())


@cuda
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N,K", [(3072, 2048), (576, 2048), (2048, 1024), (8, 2048)])
def test_gemv_mini_shapes_and_graph(M, N, K):
    from tests.ops.graph_check import assert_replay_matches_eager

    g = torch.Generator(device="cuda").manual_seed(M + N)
    w = torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    _close(gemv_triton(x, w), F.linear(x, w))

    def two(a):  # the second GEMV reads the first one's output: the PDL wait must hold
        return gemv_triton(gemv_triton(a, w)[:, :K].contiguous() if N >= K else a, w)

    assert_replay_matches_eager(two, [x.clone()], [torch.randn_like(x)])
