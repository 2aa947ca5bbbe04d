"""The CUDA GEMV chain (kestrel.ops.linear.cuda_chain, an experiment off the model's path) against the plain-torch
chain: it compiles for sm_90 here with nvcc, without spilling; on a GPU every stage's output matches
`gemv_chain_reference`, at every depth and with rows that do not divide among the blocks, and no block gives up."""

from __future__ import annotations

import ctypes
import functools
import re
import subprocess

import pytest
import torch

from kestrel.ops import nvcc
from kestrel.ops.linear import cuda_chain
from kestrel.ops.linear.triton_chain import gemv_chain_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_compiles_for_sm90_without_spills(tmp_path):
    found = nvcc.find_nvcc()
    if found is None:
        pytest.skip("no nvcc")
    done = subprocess.run(
        [
            found,
            *nvcc.FLAGS,
            "-arch=sm_90",
            "-Xptxas",
            "-v",
            "-o",
            str(tmp_path / "chain.so"),
            str(cuda_chain.SOURCE),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    usage = [line for line in done.stderr.splitlines() if "spill" in line]
    assert usage and all("0 bytes spill stores, 0 bytes spill loads" in line for line in usage), usage
    # the ring is what the device allows a block less STATIC_SMEM: each kernel's static shared memory must fit it
    smem = [int(m) for m in re.findall(r"(\d+) bytes smem", done.stderr)]
    assert smem and max(smem) <= cuda_chain.STATIC_SMEM, (smem, cuda_chain.STATIC_SMEM)


def _weights(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16) for n, k in shapes]


@cuda
@pytest.mark.parametrize(
    "mode",
    [{}, dict(copy_apart=True, release=True), dict(tma=True), dict(ll=True), dict(tma=True, ll=True), dict(pipe=True),
     dict(pipe=True, ll=True), dict(pipe=True, ll=True, producers4=True, page_bytes=4096),
     dict(pipe=True, ll=True, own_pages=True), dict(pipe=True, own_pages=True, page_bytes=4096)],
)  # fmt: skip
@pytest.mark.parametrize("depth", [0, 1, 3, cuda_chain.MAX_DEPTH])
@pytest.mark.parametrize("blocks", [None, 7])
def test_chain_matches_the_reference(depth, blocks, mode):
    # widths that do not divide among the blocks, K from one 16-byte unit to 2048, some stages with fewer rows
    # than blocks; a small ring makes the copies wrap around it
    shapes = [(300, 2048), (1000, 296), (16, 1000), (2048, 8), (133, 2048), (64, 128)]
    weights = _weights(shapes)
    for ring in (None, 16 * 1024) if blocks is None else (None,):
        _check_chain(weights, depth=depth, blocks=blocks, ring_bytes=ring, **mode)


def _check_chain(weights, **kwargs):
    """The chain's every stage against the plain-torch chain, its outputs poisoned first; no block gave up."""
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    chain = cuda_chain.CudaGemvChain(weights, **kwargs)
    for out in chain.outputs:
        out.fill_(float("nan"))
    chain.input.copy_(x)
    chain()
    for got, want in zip(chain.outputs, gemv_chain_reference(x, weights)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert not chain.gave_up()


@cuda
@pytest.mark.parametrize(
    "mode",
    [dict(pipe=True, mma=True), dict(pipe=True, ll=True, mma=True),
     dict(pipe=True, ll=True, mma=True, page_bytes=8192), dict(pipe=True, ll=True, mma=True, mma_lanes=True),
     dict(pipe=True, ll=True, mma=True, mma_packed=True), dict(pipe=True, mma=True, mma_packed=True, page_bytes=8192),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=1), dict(pipe=True, ll=True, mma=True, depth=3),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_parts=4, page_bytes=32768),
     dict(pipe=True, mma=True, mma_parts=2), dict(pipe=True, ll=True, mma=True, mma_packed=True, poll_sleep=True),
     dict(pipe=True, ll=True, own_pages=True)],
)  # fmt: skip
@pytest.mark.parametrize("blocks", [None, 7])
def test_mma_chain_matches_the_reference(blocks, mode):
    # mma's k-blocks take K a multiple of 16; a block's rows that do not fill its last 16-row page, a row's last
    # page narrower than the rest (K 1008 and 2000), stages with fewer rows than blocks; a 40 KB ring of 2-4 pages,
    # and with 7 blocks, stages of more pages than the ring has slots (where a warp that owned every 15th page,
    # not a slot, could take a slot's open phase for the one before it: mma and own_pages alike)
    shapes = [(1100, 2048), (2000, 1008), (300, 2000), (2048, 16), (133, 2048), (40, 128), (9, 32)]
    weights = _weights(shapes, seed=2)
    for ring in (None, 40 * 1024) if blocks is None else (None,):
        _check_chain(weights, blocks=blocks, ring_bytes=ring, **mode)


@cuda
@pytest.mark.parametrize(
    "mode",
    [
        {},
        dict(pipe=True, ll=True, mma=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True),
        dict(tma=True, ll=True),
        dict(pipe=True),
        dict(pipe=True, ll=True),
        dict(pipe=True, ll=True, own_pages=True),
    ],
)
def test_chain_replays_in_a_graph(mode):
    weights = _weights([(4232, 2048), (2048, 1024)] * 3, seed=1)
    chain = cuda_chain.CudaGemvChain(weights, **mode)
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    chain.input.copy_(x)
    want = chain().clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    chain.outputs[-1].zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(chain.outputs[-1], want)
    assert not chain.gave_up()


def test_refuses_what_it_cannot_take():
    if not torch.cuda.is_available():
        with pytest.raises(AssertionError, match="on CUDA"):
            cuda_chain.CudaGemvChain([torch.zeros(8, 8, dtype=torch.bfloat16)])
        return
    w = torch.zeros(8, 12, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(AssertionError, match="multiple of 8"):
        cuda_chain.CudaGemvChain([w])
    with pytest.raises(AssertionError, match="depth"):
        cuda_chain.CudaGemvChain([w[:, :8]], depth=cuda_chain.MAX_DEPTH + 1)
    with pytest.raises(AssertionError, match="variant of pipe"):
        cuda_chain.CudaGemvChain([w[:, :8]], mma=True)
    with pytest.raises(AssertionError, match="variants of mma"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma_lanes=True)
    with pytest.raises(AssertionError, match="variants of mma"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma_packed=True)
    with pytest.raises(AssertionError, match="mma_parts 3"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma=True, mma_parts=3)
    with pytest.raises(AssertionError, match="no lanes"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma=True, mma_lanes=True, mma_packed=True)
    with pytest.raises(AssertionError, match="multiple of 16"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma=True)
    wide = torch.zeros(4096, 2048, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(AssertionError, match="partial sums"):
        cuda_chain.CudaGemvChain([wide], pipe=True, mma=True, blocks=1)
    # a row wider than pipe's page would spill into the next slot (found in review, session 63)
    with pytest.raises(AssertionError, match="whole rows"):
        cuda_chain.CudaGemvChain([wide[:300]], pipe=True, page_bytes=2048)


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    """cuda_chain.cu built for sm_90 and loaded on the host (its host functions need no GPU)."""
    found = nvcc.find_nvcc()
    if found is None:
        pytest.skip("no nvcc")
    out = tmp_path_factory.mktemp("chain") / "chain.so"
    done = subprocess.run(
        [found, *nvcc.FLAGS, "-arch=sm_90", "-o", str(out), str(cuda_chain.SOURCE)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return ctypes.CDLL(str(out))


@pytest.mark.parametrize(
    "N,K,blocks,kc",
    [
        (37, 160, 3, 64),
        (70, 2048, 3, 512),
        (5, 48, 7, 32),
        (4232, 1008, 132, 512),
        (33, 16, 1, 512),
        (300, 2000, 7, 1024),
    ],
)
def test_mma_packing_is_what_the_kernel_reads(host_lib, N, K, blocks, kc):
    # pack_mma_pages' layout read back by cuda_chain.cu's own arithmetic (kestrel_chain_unpack: the producer's page
    # offsets, the consumer's swizzle, the blocks' rows): rows that do not divide among the blocks, blocks with no
    # rows, pages narrower than a swizzle group, swizzled and not. The GPU tests run the kernel on it too.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    packed = cuda_chain.pack_mma_pages(w, blocks, kc)
    assert packed.shape == (N * K,)
    bits = packed.view(torch.int16).contiguous()
    back = torch.zeros(N, K, dtype=torch.int16)
    host_lib.kestrel_chain_unpack(
        ctypes.c_void_p(bits.data_ptr()), ctypes.c_void_p(back.data_ptr()), N, K, blocks, kc
    )
    assert torch.equal(back, w.view(torch.int16))


def test_trace_summary_reads_the_points():
    # two blocks, three stages, a 2 GHz clock (each block's own offset: cycles do not compare across SMs): block
    # b's stage s starts at 10 (s + 1) + b us, its input in 3 + 0.5 b us later, its pages summed 1 us after that,
    # stored 0.5 + b us after; the producer has the first page 2 us before the start and issues the last 1 us
    # before the input is in. Block 1 has no rows in stage 2 (no first page; its last page's point far off): left
    # out of the spans, not of the stage's period
    blocks, stages = 2, 3
    trace = torch.zeros(blocks, stages, 16, dtype=torch.int64)
    for b in range(blocks):
        for s in range(stages):
            start = 10_000 * (s + 1) + 1_000 * b  # ns
            inp = start + 3_000 + 500 * b
            points = [start, inp, inp + 1_000, inp + 1_500 + 1_000 * b, start - 2_000, inp - 1_000]
            for k, at in enumerate(points):
                trace[b, s, 8 + k] = at
                trace[b, s, k] = 2 * at + 7_000_000 * (b + 1)
    trace[1, 2, 4] = trace[1, 2, 12] = 0
    # its last page's point as the producer writes it there: when it ended the stage before
    trace[1, 2, 13] = trace[1, 2, 8] - 50_000
    got = cuda_chain.chain_trace_summary(trace)
    assert got["clock_ghz"] == pytest.approx(2.0)
    assert got["input_wait_us"] == {"median": pytest.approx(3.0), "max": pytest.approx(3.5)}
    assert got["pages_after_input_us"] == {"median": pytest.approx(1.0), "max": pytest.approx(1.0)}
    assert got["stores_us"] == {"median": pytest.approx(0.5), "max": pytest.approx(1.5)}
    assert got["first_page_ahead_us"] == {"median": pytest.approx(2.0), "max": pytest.approx(2.0)}
    assert got["last_page_ahead_us"] == {"median": pytest.approx(1.0), "max": pytest.approx(1.0)}
    # across the blocks, from the last block to reach each point: block 1 stores stage s at 10 (s + 1) + 7 us, and
    # the last input in at s is block 1's at 10 (s + 1) + 4.5
    assert got["stage_period_us"] == {"median": pytest.approx(10.0), "max": pytest.approx(10.0)}
    assert got["input_latency_us"]["median"] == pytest.approx(10.0 + 4.5 - 7.0)
    with pytest.raises(AssertionError, match="no traced call"):
        cuda_chain.chain_trace_summary(torch.zeros(blocks, stages, 16, dtype=torch.int64))


def test_trace_by_class_aligns_the_blocks_clocks():
    # four blocks, each its own clock (1.8 GHz, its own origin), the ns timer in steps of 256 ns; stages of two
    # shapes in turn. Block b sees stage s's input 1 + 0.2 b us after the last block stored stage s - 1, sums
    # for 0.5 us (0.8 for shape A) and stores for 0.4: block 3 is always the last, the critical one. Its first page
    # is in as the input is, its last 0.05 us after. The first layer (stages 0 and 1) is left out.
    blocks, classes = 4, ["A", "B"] * 4
    stages = len(classes)
    true = torch.zeros(blocks, stages, 8, dtype=torch.float64)  # us
    last_store = 0.0
    for s, label in enumerate(classes):
        sums = 0.8 if label == "A" else 0.5
        for b in range(blocks):
            inp = last_store + 1.0 + 0.2 * b
            true[b, s] = torch.tensor(
                [last_store + 0.1, inp, inp + sums, inp + sums + 0.4, inp - 3, inp - 1, inp, inp + 0.05]
            )
        last_store = true[:, s, 3].max().item()
    true += 5.0  # the timer's origin past 0 (0 is "not recorded")
    trace = torch.zeros(blocks, stages, 16, dtype=torch.int64)
    trace[..., 8:] = (true * 1e3 // 256 * 256).long()
    trace[..., :8] = (true * 1e3 * 1.8).long() + 10_000_000 * torch.arange(1, blocks + 1)[:, None, None]
    got = cuda_chain.chain_trace_summary(trace, classes)["by_class"]
    assert set(got) == {"A", "B"} and got["A"]["stages"] == 3 and got["B"]["stages"] == 3
    for label, sums in (("A", 0.8), ("B", 0.5)):
        g = got[label]
        close = functools.partial(pytest.approx, abs=0.06)
        assert g["period"] == close(1.6 + sums + 0.4) and g["period_mean"] == close(1.6 + sums + 0.4)
        # torch.median: the lower middle one of 1.0 1.2 1.4 1.6
        assert g["latency"] == close(1.2) and g["latency_max"] == close(1.6)
        assert g["sums"] == close(sums) and g["last_page_wait"] == close(0.05)
        assert g["critical_latency"] == close(1.6) and g["critical_sums"] == close(sums)
        assert g["critical_stores"] == close(0.4) and g["critical_last_page_wait"] == close(0.05)
    with pytest.raises(AssertionError, match="classes for"):
        cuda_chain.chain_trace_summary(trace, classes[:-1])


@cuda
def test_traced_chain_matches_and_orders_its_points():
    weights = _weights([(4232, 2048), (2048, 1024)] * 2, seed=3)
    chain = cuda_chain.CudaGemvChain(
        weights, pipe=True, ll=True, mma=True, mma_packed=True, depth=2, trace=True
    )
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    chain.input.copy_(x)
    got = chain().float()
    want = gemv_chain_reference(x, weights)[-1].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    t = chain.trace.cpu()
    assert (t[..., :4] > 0).all() and (t[..., 8:14] > 0).all()  # every block has rows in every stage here
    cycles = t[..., :4]
    assert (cycles[..., 1:] >= cycles[..., :-1]).all()  # start, input in, pages summed, stored
    summary = chain.trace_summary()
    assert 0.5 < summary["clock_ghz"] < 3.0 and summary["stage_period_us"]["median"] > 0
    assert (t[..., 14:16] > 0).all()  # each stage's first and last page in
    assert (t[..., 7] >= t[..., 6]).all() and (t[..., 6] >= t[..., 1]).all()  # after the input, in order
    by_class = summary["by_class"]
    assert set(by_class) == {"4232x2048", "2048x1024"}
    assert all(c["stages"] == 1 and c["period"] > 0 and c["critical_sums"] > 0 for c in by_class.values())
