"""Greedy decoding's Triton argmax against `naive.greedy` (torch.argmax): exactly the same ids, ties to the
lowest id, on random, tied, planted and fully masked rows whose width does not divide the kernel's chunks, fp32
and bf16, strided rows and a single 1-D row. Without CUDA it runs under TRITON_INTERPRET=1 (small sizes); with
CUDA the same cases run compiled, plus a decode-sized batch (256 x 129280)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: before the first import
pytest.importorskip("triton")

from kestrel.ops.sampling.naive import greedy  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _load():
    name = "kestrel.ops.sampling.triton_greedy"
    fresh = name not in sys.modules
    module = importlib.import_module(name)
    return module if fresh else importlib.reload(module)


_mod = _load()
greedy_triton, CHUNK = _mod.greedy_triton, _mod.CHUNK


def _check(x: torch.Tensor) -> None:
    got, want = greedy_triton(x), greedy.eager(x)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("V", [1, 7, CHUNK - 1, CHUNK, CHUNK + 3, 2 * CHUNK + 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows(V, dtype):
    g = torch.Generator().manual_seed(V)
    _check(torch.randn(3, V, generator=g).to(DEV, dtype))


def test_ties_go_to_the_lowest_id():
    V = 2 * CHUNK + 50
    x = torch.zeros(5, V)
    x[0, [9, CHUNK + 2, V - 1]] = 3.0  # a tie across chunks: the first chunk's wins
    x[1, [CHUNK + 5, CHUNK + 1]] = 2.0  # inside one chunk, not the first
    x[2, [V - 1]] = 1.0  # the last id alone
    x[3] = torch.randint(0, 3, (V,), generator=torch.Generator().manual_seed(0)).float()  # many ties
    x[4] = float("-inf")  # every id masked (min_tokens banning everything): id 0, as torch gives
    _check(x.to(DEV))
    _check(x.to(DEV, torch.bfloat16))


def test_strided_rows_and_a_single_row():
    wide = torch.randn(4, CHUNK + 300, generator=torch.Generator().manual_seed(1)).to(DEV)
    _check(wide[:, 100:])  # rows with a row stride wider than the row
    _check(wide[1])  # [V] -> a 0-d id
    _check(wide[:0])  # no rows


@pytest.mark.skipif(not CUDA, reason="a decode-sized batch: compiled only")
def test_decode_sized_batch():
    x = torch.randn(256, 129280, device="cuda")
    x[7, 129279] = 1e4
    _check(x)
    _check(x.bfloat16())
