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
from kestrel.ops.linear import cuda_chain, cuda_chain_trace
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
     dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, test_wait=True),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_fold=True),
     dict(pipe=True, mma=True, mma_packed=True, mma_fold=True, page_bytes=8192),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_pipelined=True),
     dict(pipe=True, mma=True, mma_packed=True, mma_pipelined=True, mma_fold=True, page_bytes=32768),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_pipelined=True, page_bytes=8192, depth=4),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_pipelined=True, mma_fold=True, page_bytes=12288),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_pipelined=True, mma_fold=True, page_bytes=10240),
     dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_pipelined=True, mma_fold=True, store_first=True),
     dict(pipe=True, ll=True, own_pages=True)],
)  # fmt: skip
@pytest.mark.parametrize("blocks", [None, 7])
def test_mma_chain_matches_the_reference(blocks, mode):
    # mma's k-blocks take K a multiple of 16; a block's rows that do not fill its last 16-row page, a row's last
    # page narrower than the rest (K 1008 and 2000), stages with fewer rows than blocks; a 40 KB ring of 2-4 pages,
    # and with 7 blocks, stages of more pages than the ring has slots (where a warp that owned every 15th page,
    # not a slot, could take a slot's open phase for the one before it: mma and own_pages alike); mma_fold's
    # short tiles in 2 to 8 segments (over 132 blocks 1100 x 2048's 8-row tiles in 2, 300 x 2000's 2- and 3-row
    # ones in 5, 133 x 2048's and 40 x 128's single rows in 8) beside tiles it leaves whole
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
        dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_fold=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_pipelined=True),
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
    with pytest.raises(AssertionError, match="mma_pipelined is mma_packed's"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma=True, mma_pipelined=True)
    with pytest.raises(AssertionError, match="store_first is mma's with ll"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma=True, store_first=True)
    with pytest.raises(AssertionError, match="mma_fold is mma_packed's"):
        cuda_chain.CudaGemvChain([w[:, :8]], pipe=True, mma=True, mma_fold=True)
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
        (4232, 2048, 132, 512),
        (300, 2000, 132, 512),
        (4232, 2048, 132, 384),
        (2048, 1024, 132, 384),
        (4232, 2048, 132, 320),
    ],
)
@pytest.mark.parametrize("fold", [False, True])
def test_mma_packing_is_what_the_kernel_reads(host_lib, N, K, blocks, kc, fold):
    # pack_mma_pages' layout read back by cuda_chain.cu's own arithmetic (kestrel_chain_unpack: the producer's page
    # offsets, the consumer's swizzle, the blocks' rows): rows that do not divide among the blocks, blocks with no
    # rows, pages narrower than a swizzle group, swizzled and not; folded, a block's last tile short of 16 rows
    # (4232 x 2048's 1-row tiles in 8 segments, 1008's in 7, 48's in 3, 70 x 2048's 7- and 8-row tiles in 2, 300 x
    # 2000's 2- and 3-row tiles in 5). The
    # GPU tests run the kernel on it too.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    packed = cuda_chain.pack_mma_pages(w, blocks, kc, fold)
    assert packed.shape == (N * K,)
    bits = packed.view(torch.int16).contiguous()
    back = torch.zeros(N, K, dtype=torch.int16)
    host_lib.kestrel_chain_unpack(
        ctypes.c_void_p(bits.data_ptr()), ctypes.c_void_p(back.data_ptr()), N, K, blocks, kc, int(fold)
    )
    assert torch.equal(back, w.view(torch.int16))


def test_each_consumer_steps_straight_to_its_own_pages(host_lib):
    # mma_consume's way to a warp's part-pages (next_owned, PageWalk) against the walk over every page it replaced:
    # the producer's order (whole 16-row tiles' pages, then a short tile's, folded or not), part p of the stage's
    # page q at ring position ((slot + q) % pages) parts + p, owned by warp position % 15, its use counted round the
    # ring. Every part-page once, each warp's in order, rings smaller and larger than 15 warps, stages of more pages
    # than the ring, parts of 1-4, short tiles folded and whole.
    cap = 512
    out = (ctypes.c_int * (6 * cap))()
    for rows, K, kc, fold in [
        (33, 2048, 512, True),
        (33, 2048, 512, False),
        (16, 1024, 512, False),
        (0, 64, 32, False),
        (37, 160, 64, True),
        (5, 48, 32, True),
        (70, 2000, 256, False),
        (200, 128, 256, False),
        (33, 2048, 384, True),
        (8, 1024, 384, True),
        (33, 2048, 320, True),
    ]:
        tiles = [(r0, cuda_chain.tile_folds(min(16, rows - r0), K, fold)) for r0 in range(0, rows, 16)]
        order = [(r0, c) for r0, f in tiles for c in range(-(-(K // f) // kc))]  # the producer's pages
        for pages in (1, 2, 7, 13, 15, 16, 26, 64):
            for parts in (1, 2, 4):
                for slot, use in {(0, 0), (pages // 2, 3), (pages - 1, 1)}:
                    taken = []
                    for cw in range(15):
                        count = host_lib.kestrel_chain_owned(
                            rows, K, kc, int(fold), slot, use, pages, parts, cw, out, cap
                        )
                        got = [tuple(out[6 * i : 6 * i + 6]) for i in range(count)]
                        want = [
                            (
                                h,
                                (slot + h // parts) % pages,
                                use + (slot + h // parts) // pages,
                                *order[h // parts],
                                h % parts,
                            )
                            for h in range(len(order) * parts)
                            if ((slot + h // parts) % pages * parts + h % parts) % 15 == cw
                        ]
                        assert got == want, (rows, K, kc, fold, pages, parts, slot, cw)
                        taken += [h for h, *_ in got]
                    assert sorted(taken) == list(range(len(order) * parts))


def test_tile_folds():
    # the largest f <= min(8, 16 / rows) with K a multiple of 16 f; whole tiles and unfolded ones stay as they are
    assert [cuda_chain.tile_folds(r, 2048, True) for r in (1, 2, 3, 5, 8, 9, 15, 16)] == [
        8,
        8,
        4,
        2,
        2,
        1,
        1,
        1,
    ]
    assert cuda_chain.tile_folds(1, 1008, True) == 7 and cuda_chain.tile_folds(1, 48, True) == 3
    assert cuda_chain.tile_folds(1, 2048, False) == 1 and cuda_chain.tile_folds(1, 16, True) == 1


def _synthetic_trace(true_us: torch.Tensor, ghz: float = 1.8) -> torch.Tensor:
    """A trace as the kernel writes it from each point's true time [blocks, stages, 11] (us, NaN: not recorded):
    each block's clock at `ghz` from its own origin, the ns timer (since 1970: ~1.7e18) at TIMED_POINTS only."""
    blocks, stages, points = true_us.shape
    trace = torch.zeros(blocks, stages, cuda_chain_trace.TRACE_WIDTH, dtype=torch.int64)
    rec = ~true_us.isnan()
    ns = (torch.nan_to_num(true_us) * 1e3).round().long()
    origin = 10_000_000 * torch.arange(1, blocks + 1)[:, None, None]
    trace[..., :points] = torch.where(rec, (ns.double() * ghz).round().long() + origin, 0)
    timed = torch.zeros(points, dtype=torch.bool)
    timed[list(cuda_chain_trace.TIMED_POINTS)] = True
    trace[..., 16 : 16 + points] = torch.where(rec & timed, ns + 1_764_000_000_000_000_000, 0)
    return trace


def test_trace_summary_reads_the_points():
    # two blocks, three stages: block b's stage s starts at 10 (s + 1) + b us, its input in 3 + 0.5 b us later,
    # its pages summed 1 us after that, stored 0.5 + b us after; the producer has the first page 2 us before the
    # start and issues the last 1 us before the input is in. Block 1 has no rows in stage 2 (no first page; its last
    # page's point where the producer writes it then, as it ended the stage before): left out of the spans, not of
    # the stage's period
    blocks, stages = 2, 3
    true = torch.full((blocks, stages, len(cuda_chain_trace.TRACE_POINTS)), float("nan"), dtype=torch.float64)
    for b in range(blocks):
        for s in range(stages):
            start = 10.0 * (s + 1) + b
            inp = start + 3 + 0.5 * b
            true[b, s, :6] = torch.tensor([start, inp, inp + 1, inp + 1.5 + b, start - 2, inp - 1])
    true[1, 2, 4] = float("nan")
    true[1, 2, 5] = true[1, 2, 0] - 50
    got = cuda_chain_trace.chain_trace_summary(_synthetic_trace(true))
    close = functools.partial(pytest.approx, abs=1e-3)
    assert got["clock_ghz"] == close(1.8)
    assert got["input_wait_us"] == {"median": close(3.0), "max": close(3.5)}
    assert got["pages_after_input_us"] == {"median": close(1.0), "max": close(1.0)}
    assert got["stores_us"] == {"median": close(0.5), "max": close(1.5)}
    assert got["first_page_ahead_us"] == {"median": close(2.0), "max": close(2.0)}
    assert got["last_page_ahead_us"] == {"median": close(1.0), "max": close(1.0)}
    # across the blocks, from the last block to reach each point: block 1 stores stage s at 10 (s + 1) + 7 us, and
    # the last input in at s is block 1's at 10 (s + 1) + 4.5
    assert got["stage_period_us"] == {"median": close(10.0), "max": close(10.0)}
    assert got["input_latency_us"]["median"] == close(10.0 + 4.5 - 7.0)
    with pytest.raises(AssertionError, match="no traced call"):
        cuda_chain_trace.chain_trace_summary(
            torch.zeros(blocks, stages, cuda_chain_trace.TRACE_WIDTH, dtype=torch.int64)
        )
    with pytest.raises(AssertionError, match="a trace row is"):
        cuda_chain_trace.chain_trace_summary(torch.zeros(blocks, stages, 16, dtype=torch.int64))


def test_trace_by_class_lines_up_the_blocks_clocks():
    # four blocks, each its own clock, the timer at the producer's points only; stages of two shapes in turn: A
    # (8 x 4: two rows a block) reads the first 4 outputs of B, every block's; B (4 x 4: a row a block) the first 4
    # of A, blocks 0 and 1's. Block b gathers stage s's input 1 + 0.2 b us after the last of those blocks stored
    # stage s - 1, has it in 0.1 us later, its first page in then and summed in 0.3 us, its last page 0.2 us after
    # the input and summed in 0.3 us, all pages summed 0.8 us (A) or 0.5 us (B) after the input, and stores for
    # 0.4: block 3 is always the last to store, the critical one. The first layer (stages 0 and 1) is left out.
    blocks, shapes = 4, [(8, 4), (4, 4)] * 4
    true = torch.full(
        (blocks, len(shapes), len(cuda_chain_trace.TRACE_POINTS)), float("nan"), dtype=torch.float64
    )
    for s, (n, _) in enumerate(shapes):
        sums = 0.8 if n == 8 else 0.5
        producers = range(blocks) if n == 8 else range(2)
        prev = max(true[b, s - 1, 3].item() for b in producers) if s else 0.0
        for b in range(blocks):
            inp = prev + 1.1 + 0.2 * b
            true[b, s] = torch.tensor(
                [prev + 0.1, inp, inp + sums, inp + sums + 0.4, inp - 3, inp - 1]
                + [inp, inp + 0.2, inp + 0.3, inp + 0.5, inp - 0.1]
            )
    trace = _synthetic_trace(true + 5.0)
    got = cuda_chain_trace.chain_trace_summary(trace, shapes)["by_class"]
    assert set(got) == {"8x4", "4x4"} and got["8x4"]["stages"] == 3 and got["4x4"]["stages"] == 3
    close = functools.partial(pytest.approx, abs=2e-3)
    for label, sums in (("8x4", 0.8), ("4x4", 0.5)):
        g = got[label]
        assert g["period"] == close(1.7 + sums + 0.4) and g["period_mean"] == close(1.7 + sums + 0.4)
        assert g["rows"] == g["critical_rows"] == (2 if label == "8x4" else 1)  # the rows block 3 holds
        # torch.median: the lower middle one of 1.1 1.3 1.5 1.7
        assert (
            g["latency"] == close(1.3)
            and g["latency_max"] == close(1.7)
            and g["critical_latency"] == close(1.7)
        )
        assert g["gathered"] == close(1.2) and g["critical_gathered"] == close(1.6)
        for span, want in (("first_page_wait", 0.0), ("first_page_sums", 0.3), ("last_page_wait", 0.2)):
            assert g[span] == close(want) and g[f"critical_{span}"] == close(want)
        assert (
            g["last_page_sums"] == close(0.3)
            and g["sums"] == close(sums)
            and g["critical_sums"] == close(sums)
        )
        assert g["stores"] == close(0.4) and g["critical_stores"] == close(0.4)
        assert g["pages_issued"] == close(2.0) and g["critical_pages_issued"] == close(2.0)
    with pytest.raises(AssertionError, match="shapes for"):
        cuda_chain_trace.chain_trace_summary(trace, shapes[:-1])


def test_compact_trace_reads_the_same():
    true = torch.full((3, 4, len(cuda_chain_trace.TRACE_POINTS)), float("nan"), dtype=torch.float64)
    for s in range(4):
        true[:, s, :6] = (
            torch.tensor([10.0, 11.0, 12.5, 13.0, 8.0, 9.0]) + 10 * s + torch.arange(3)[:, None] * 0.3
        )
    true[2, 3, 4] = float("nan")  # no rows there
    trace = _synthetic_trace(true + 5.0)
    small = cuda_chain_trace.compact_trace(trace)
    assert small.dtype == torch.int32 and torch.equal(small == 0, trace == 0)
    assert cuda_chain_trace.chain_trace_summary(small) == cuda_chain_trace.chain_trace_summary(trace)


def test_trace_fit_of_a_block_with_no_rows_takes_the_others_slope():
    # block 1 has no rows in any stage: no first page, and its producer's last-page points all at the start, one
    # clock value: its line takes block 0's slope and fits its offset alone, so its consumers' points still land
    # where they were: with block 0's, which were at the same times (the line's origin is the first timer value)
    true = torch.full((2, 3, len(cuda_chain_trace.TRACE_POINTS)), float("nan"), dtype=torch.float64)
    for s in range(3):
        true[:, s, :4] = torch.tensor([10.0, 11.0, 12.0, 13.0]) + 10 * s
        true[0, s, 4:6] = torch.tensor([8.0, 9.0]) + 10 * s
    true[1, :, 5] = 1.0
    at, ghz = cuda_chain_trace.aligned_us(_synthetic_trace(true + 5.0))
    assert ghz == pytest.approx(1.8, rel=1e-4)
    torch.testing.assert_close(at[1, :, :4], at[0, :, :4], atol=2e-3, rtol=0)
    torch.testing.assert_close(at[0, :, :4] - at[0, 0, 0], true[0, :, :4] - 10.0, atol=2e-3, rtol=0)
    assert at[1, :, 4].isnan().all()


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
    points = len(cuda_chain_trace.TRACE_POINTS)
    assert (t[..., :points] > 0).all()  # every block has rows in every stage here: every point recorded
    assert (t[..., 16:22] > 0).sum(dim=-1).eq(2).all() and (
        t[..., 20:22] > 0
    ).all()  # the timer: 4 and 5 alone
    cycles = t[..., :4]
    assert (cycles[..., 1:] >= cycles[..., :-1]).all()  # start, input in, pages summed, stored
    assert (t[..., 10] <= t[..., 1]).all()  # consumer 0's share of the input in, then the sync
    for wait, summed in ((6, 8), (7, 9)):
        # each page in after consumer 0's share of the input (the consumers' sync between: not after its point 1,
        # which another warp may pass first), then summed, then every page summed
        assert (t[..., wait] >= t[..., 10]).all() and (t[..., summed] >= t[..., wait]).all()
        assert (t[..., 2] >= t[..., summed]).all()
    summary = chain.trace_summary()
    assert 0.5 < summary["clock_ghz"] < 3.0 and summary["stage_period_us"]["median"] > 0
    by_class = summary["by_class"]
    assert set(by_class) == {"4232x2048", "2048x1024"}
    assert all(c["stages"] == 1 and c["period"] > 0 and c["critical_sums"] > 0 for c in by_class.values())


def test_chain_trace_plot_draws_a_kept_trace(tmp_path, capsys):
    import io
    import tarfile

    from tests.scripts import load_script

    plot = load_script("chain_trace_plot")
    blocks, shapes = 3, [(6, 4), (3, 4)] * 3
    true = torch.full(
        (blocks, len(shapes), len(cuda_chain_trace.TRACE_POINTS)), float("nan"), dtype=torch.float64
    )
    for s in range(len(shapes)):
        for b in range(blocks):
            inp = 5.0 * s + 1 + 0.2 * b
            true[b, s] = torch.tensor(
                [
                    inp - 1,
                    inp,
                    inp + 1,
                    inp + 1.2,
                    inp - 3,
                    inp - 2,
                    inp,
                    inp + 0.1,
                    inp + 0.5,
                    inp + 0.6,
                    inp - 0.1,
                ]
            )
    kept = {"trace": cuda_chain_trace.compact_trace(_synthetic_trace(true + 5.0)), "shapes": shapes}
    buf = io.BytesIO()
    torch.save(kept, buf)
    tgz = tmp_path / "a.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        info = tarfile.TarInfo("a/chain_trace_0.pt")
        info.size = len(buf.getvalue())
        tar.addfile(info, io.BytesIO(buf.getvalue()))
    plot.main([str(tgz), "--out", str(tmp_path / "png")])
    printed = capsys.readouterr().out
    assert "chain_trace_0 6x4 (2 stages): period" in printed and "chain_trace_0 3x4 (2 stages)" in printed
    assert (tmp_path / "png" / "chain_trace_0.png").stat().st_size > 1000
    assert plot.stage_range(None, 6, 2) == range(2, 6) and plot.stage_range("1:3", 6, 2) == range(1, 3)
    for bad, match in (
        ([str(tmp_path / "none.tgz")], "no such file"),
        ([str(tgz), "--stages", "x"], "want FIRST:END"),
        ([str(tgz), "--stages", "9:12"], "no stage of the chain's 6"),
    ):
        with pytest.raises(SystemExit, match=match):
            plot.main(bad)
    empty = tmp_path / "empty.tgz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(SystemExit, match="no chain_trace"):
        plot.main([str(empty)])
