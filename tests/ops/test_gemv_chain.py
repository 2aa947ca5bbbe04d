"""The persistent GEMV chain (kestrel.ops.linear.triton_chain) against its plain-torch reference. Without CUDA the
kernel runs under TRITON_INTERPRET=1 with one program (fp32); with CUDA in bf16 over a grid of every SM, with and
without the L2 requests ahead, and replayed in a CUDA graph. Each stage's output is poisoned before the run: a
column the kernel never writes fails the comparison."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.ops.kernel_modules import load_kernels  # sets TRITON_INTERPRET without CUDA

triton = pytest.importorskip("triton")

load_kernels("kestrel.ops.linear.triton_chain")
from kestrel.ops.linear.triton_chain import GemvChain, gemv_chain_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (N, K) a stage; each K at most the stage before's N (it reads that many of its first columns); tile-splitting
# widths, a width of 1, a K past one K step
SHAPES = [(37, 50), (64, 37), (1, 20), (300, 1), (45, 300), (16, 45)]


def _weights(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, DTYPE) for n, k in shapes]


def _run_and_check(chain, weights, x):
    chain.input.copy_(x)
    for out in chain.outputs:
        out.fill_(float("nan"))
    last = chain()
    assert not chain.gave_up()
    want = gemv_chain_reference(x, weights)
    tol = 3e-2 if DTYPE == torch.bfloat16 else 1e-5
    for s, (got, ref) in enumerate(zip(chain.outputs, want)):
        assert got.shape == ref.shape, s
        torch.testing.assert_close(
            got.float(), ref.float(), rtol=tol, atol=tol * (1 + ref.float().abs().max().item())
        )
    assert last.data_ptr() == chain.outputs[-1].data_ptr()


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_chain_matches_the_reference(rows):
    weights = _weights(SHAPES, rows)
    x = torch.randn(rows, SHAPES[0][1], generator=torch.Generator().manual_seed(9)).to(DEVICE, DTYPE)
    _run_and_check(GemvChain(weights, rows, block_n=16, block_k=32), weights, x)


def test_chain_refuses_what_it_cannot_take():
    weights = _weights([(8, 16), (4, 9)], 0)  # the second stage reads 9 columns of 8
    with pytest.raises(AssertionError, match="first K columns"):
        GemvChain(weights)
    with pytest.raises(AssertionError, match="1 to 16"):
        GemvChain(_weights([(8, 16)], 0), rows=17)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the tests below compile and run the kernel itself"
)
def test_chain_compiles_for_hopper():
    """The interpreter runs what the compiler may refuse (a global that is not a constexpr, an atomic's order):
    the kernel compiled for sm_90 here, with and without the L2 requests (their inline PTX in the code), in a
    process of its own (this one may have decorated the kernel for the interpreter)."""
    code = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from kestrel.ops.linear.triton_chain import MAX_SPIN, _chain_kernel
        sig = dict(w="*bf16", acts="*bf16", meta="*i64", sync="*i32", M="i32", S="i32", nprog="i32")
        for ahead in (0, 2):
            consts = dict(BM=16, BN=32, BK=256, AHEAD=ahead, OWN=False, ELEM=2, DOT_F32=False, PRECISION="tf32",
                          MAX_SPIN=MAX_SPIN)
            src = ASTSource(fn=_chain_kernel, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
            assert ("cp.async.bulk.prefetch.L2" in ptx) == (ahead > 0), ahead
            consts["OWN"] = True
            src = ASTSource(fn=_chain_kernel, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
            assert "cp.async.bulk.prefetch.L2" in ptx, "own: a stage's rows asked before they are read"
            assert "atom.global.gpu.acq_rel.add" in ptx, "the arrival orders the stage's stores"
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@cuda
@pytest.mark.parametrize("ahead,own", [(0, False), (0, True), (1, False), (3, True)])
@pytest.mark.parametrize("block_n", [16, 32])
def test_chain_on_every_sm(ahead, own, block_n):
    """A grid of every SM, most programs with no tile in the small stages; mini-like widths beside the odd ones."""
    shapes = [(4232, 2048), (2048, 1024), *SHAPES[:1], (37, 37)] * 2
    shapes[4] = (4232, 37)  # each K at most the stage before's N
    weights = _weights(shapes, ahead)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    chain = GemvChain(weights, 1, block_n=block_n, ahead=ahead, own=own)
    assert chain.programs == torch.cuda.get_device_properties(0).multi_processor_count
    _run_and_check(chain, weights, x)
    again = [o.clone() for o in chain.outputs]
    chain()
    assert all(torch.equal(a, o) for a, o in zip(again, chain.outputs))  # the same bits every call


@cuda
def test_chain_replays_in_a_cuda_graph():
    weights = _weights(SHAPES, 3)
    chain = GemvChain(weights, 2)
    x = torch.randn(2, SHAPES[0][1], generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
    chain.input.copy_(x)
    chain()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for out in chain.outputs:
        out.fill_(float("nan"))
    graph.replay()
    graph.replay()  # the counters start from zero at each replay
    torch.cuda.synchronize()
    assert not chain.gave_up()
    for got, ref in zip(chain.outputs, gemv_chain_reference(x, weights)):
        torch.testing.assert_close(
            got.float(), ref.float(), rtol=3e-2, atol=3e-2 * (1 + ref.float().abs().max().item())
        )
