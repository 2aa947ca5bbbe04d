"""A chain of dependent GEMVs at one row in one persistent CUDA launch whose blocks stream the weights of the
stages ahead into shared memory while they wait at the grid barrier (cuda_chain.cu has the algorithm): issue 4's
second experiment towards a batch-1 megakernel, after `triton_chain` (the same chain in Triton, 1.8x slower
than the GEMV launches it would replace: Triton keeps one stage's slice in flight a program, in registers). Not
on the model's path: `scripts/decode_kernels_check.py --sections l2_ahead` times it beside the launches, the
Triton chain and the weights' floor.

What it answers: whether a persistent kernel that keeps the weight stream going across its waits runs the
projections near their bytes' time, and what one dependent stage costs it (the barrier, the input's read from
L2), so that a whole-step megakernel's time can be put at (stages x that cost) against the step's bytes.

Measured (session 61, H100, bench/results/2026-12-06-h100-session61.json, calls q-x; mini's KDA projections,
4232 x 2048 then 2048 x 1024, 24 layers; us a layer, with the floor, the launches and the Triton chain in the same
runs: floor 7.08, the 48 rows-GEMV launches 9.44-9.53, their weights in L2 6.2-6.3, the Triton chain 23.2-23.4):
- chain_kernel (a block's rows of a stage copied as one cp.async group, freed as a whole, a counter a stage):
  18.5-20.5 at every depth 0-63, with the arrival a release add or warp 0 copying nothing; as bulk copies (tma)
  and LL pairs (ll) 18.5-19.3; with no barrier at all 13.1. Barriers alone (64 x 64 weights): 6.5-7.0 a layer with
  the counter (3.2-3.5 a stage), 5.6-5.8 with LL pairs.
- chain_pipe_kernel (pipe): with LL pairs 17.1-17.5 (its best; 19.5 with a 32 KB ring), with the counter 19.3-20.6;
  with no barrier 14.7-16.8; the stream alone (the consumers only free the pages) **8.3-8.7** with 16-32 KB pages
  and rings of 64-217 KB (2.5-2.6 TB/s, 85% of the copy rate; 8 KB pages 10.7, a 32 KB ring 9.4, four producer
  lanes no better, lane 0 alone polling each page 10.0), and the same with one layer's weights in L2 as from HBM;
  barriers alone **4.4-4.9 a layer, 2.2-2.4 us a stage** (LL), 5.3-5.6 with the counter. Without the input's
  read 12.3 against 16.5 (no barrier).
- Nsight Compute on pipe with LL (calls y and z, `scripts/cuda_chain_ncu.py`): a scheduler issues in 0.30 of its
  cycles, 0.5 of its 4 warps eligible; the stalls an issued instruction: 3.7 MIO throttle (the shared-memory pipe:
  the pages' reads and mbarrier polls), 2.9 fixed-latency waits, 1.4 barrier, 1.1 global loads (no barrier: 2.1
  global loads, 2.8 waits, 1.3 barrier); 126 M warp instructions, of which the sums take about 30 M. The sums
  are latency-bound, one row at a time a warp, and do not overlap the stream.
- own_pages (call A: each page waited for, summed four rows at a time and freed by one warp): the stream alone
  **7.6** (2.8 TB/s, 93% of the copy rate: fewer pollers), yet with LL 17.0-17.6 (16 and 8 KB pages; 22.9 with
  32 KB), with the counter 19.8, with no barrier 14.6: the chain's time stays near the stream's plus the consumers'
  own (input reads, sums, the stage's barrier), as if the two did not overlap at all.
- no_stream (call C: pages completed without a copy, the consumers' own work alone): **15.6 with LL, 10.9 with no
  barrier** (the stream alone 7.7, both 14.8): the consumers' work is most of the chain's time and overlaps the
  stream only in part. One cost found in the code after it: each stage read its table entries from global memory,
  an L2 round trip before its input's address was known; pipe now reads the table into shared memory once
  (e84e398: compiled for sm_90, checked on the CPU, neither timed nor GPU-tested: no device time was left).
So: the stream alone runs 1.9 us a layer under the launches (7.6 against 9.5, floor 7.1), and a dependent stage
costs 2.2 us against the ~2.9 a GEMV launch adds to its bytes (session 54); what this chain never reached is the
consumers' work hidden under the stream: with it, every variant took 14.6-20.6 us a layer, 1.5-2.2x the launches,
and the consumers alone take 10.9 (no barrier) to 15.6 (LL) us a layer for 49 rows an SM: their input reads, sums and
stage barriers are slower than the bytes they sum. A megakernel would have to make that work cheaper (and hide it)
before it could beat the launches at all.

Session 62's two steps at that work, both compiled for sm_90 and checked on the CPU (no spills; the static shared
memory within STATIC_SMEM), neither timed nor GPU-tested yet (fifteen asks for a machine finished no call):
- the LL input gathered as bf16 and read back as 16-byte units (3e80891): as fp32 at xs[8u + j] each lane's loads
  hit 4 banks, 8 wavefronts a load (call z: 43 M shared wavefronts with LL against 5 M without);
- `mma` (fb05f16): the sums on the tensor cores. By the instruction count of call z (126 M warp instructions, about
  20 K a layer an SM against ~5 K for the fmas themselves), the consumers issue too much: a lane's 8 weights cost an
  LDS, 8 conversions and 8 fmas. An mma.sync m16n8k16 takes 256 weights for an ldmatrix, an 8-byte load of the
  input (B, the same in all 8 columns) and itself. Its pages are 16 rows x PAGE_BYTES / 32 columns, a bulk copy a
  row into lines 16 bytes apart (ldmatrix conflict-free), a warp a page; each page's 16 partial sums go to shared
  memory and a row adds them in column order (no atomics: the same result every run). `l2` times it by page size,
  with and without barriers and stream (the stream alone answers whether a copy a row holds the stream back).
  A page's owner is its slot's (slot % 15): with page g's owner warp g % 15, as own_pages had it, a warp could take
  a slot's open phase for the one before it once a stage has more pages than the ring has slots (mma_consume).
  `mma_lanes` (session 63) spreads a page's 16 row copies over 16 lanes of the producer warp, where lane 0 issues
  all 16: `l2` times the two side by side, with LL and as the stream alone.

Session 64 (H100, bench/results/2026-12-06-h100-session64.json, calls a-c; floor 7.08-7.09, launches 9.51-9.52 in
the same runs; the chain's figures differ by up to 2 us a layer from one call to the next, the floor's and the
launches' do not): every variant correct on the GPU (the tests' 117 cases in call c).
- mma with LL 13.8-14.8 (32 KB pages 11.0-14.2, 8 KB 25-28); its consumers alone (no_stream) 6.9-8.9 with LL,
  6.7-8.9 with no barrier, where pipe's were 15.6 and 10.9; barriers alone 3.6-3.8.
- mma_lanes with LL **10.1**-11.5; its stream alone 8.7-9.2 against lane 0's 11.6-12.3 (a copy a row from one
  lane held the stream back).
- `mma_packed` (the weights packed on the host in the producer's order, pack_mma_pages: a page one bulk copy, no
  padding, each row's 16-byte units swizzled by row for ldmatrix): the stream alone **8.1-8.2** (16 KB pages) and
  **7.7-8.0** (32 KB), as pipe's whole-row pages; yet with LL 12.7-13.6, 12.2-12.5 (8 KB), 14.4-16.7 (32 KB); with
  no barrier 11.6-12.0, and 10.6 without the input's read too: the consumers' time still adds to the stream's.
- the copies in flight capped (`depth`, call c): with LL **10.4** at 2 pages in flight (1: 11.7, 4: 12.3; 8 KB
  pages 3 and 6: 11.9), the stream alone 8.8 at 2 and 8.1 at 4; with no barrier 10.8 at 2 (10.0 without the input's
  read). Fewer bytes in flight ahead of a stage's input read shorten the chain: the read queues behind them.
- `mma_parts` (a page's k-blocks split among 2-8 warps): no better, 12.3 (2), 13.2 (4), 12.6-13.2 (4 and 8 on
  32 KB pages), and the consumers alone 12.4 with 4 against 8.5 with 1: more waits on each page's barrier, more
  partial sums.
- Nsight Compute on mma_parts 4 with LL: 103 M warp instructions (33 K a layer an SM, where the ldmatrix, mma and
  input loads need about 5 K: the rest polls of mbarriers and LL pairs), a scheduler issuing in 37% of its cycles,
  the stalls an issued instruction 2.9 fixed-latency waits, 2.7 barrier, 1.5 branch resolving, 1.1 global loads.
So the best chain so far is 10.1-10.4 us a layer against the launches' 9.5 (1.07-1.10x), with its stream alone at
8.1 and its consumers alone at 8.5-8.9: each is near the launches by itself, so the consumers' own work (most of it
polling) has to shrink before the two can overlap into anything under 9.5. To see where it goes, mma takes
`trace=True` (written after call c, untimed): the SM clock and the ns timer at each stage's TRACE_POINTS in each
block, summed up by `trace_summary` (the input's wait, the sums after it, the stores, the producer's lead, a
stage's period across the blocks); `l2` records it for five configurations. And `poll_sleep` (untimed too): with
LL every consumer thread of every block polls its input pairs from L2 until they are there, some 60 K 16-byte reads
in flight over the GPU while a stage waits; 128 ns asleep between tries asks whether that traffic holds the weight
stream back.

Session 65 (call a on an H100, b on an H200; bench/results/2026-12-06-h100-h200-session65.json; the floor and the
launches in the same runs: H100 7.09 and 9.48, H200 5.07 and 7.75): the best chain, packed with LL at 2 pages in
flight, takes 10.44 on the H100 and **9.99 on the H200**: no faster where the bytes are (1.10x the launches there,
1.29x here), so its bound is the consumers' own chain of work. With no stream and no barrier (no stage waits for
another) they take 9.85 a layer on the H200, 5.66 without their sums (`no_compute`: the pages' handshakes, the
syncs and the stores alone) and 9.07 without the input's read. The first traces (calls a and b) split a stage's
time by shape on the H200, medians: 4232 x 2048 (a block's 32-33 rows in 8-12 pages) a period of 6.0, its input
latency 1.0, its sums 3.5 (the last block's 4.5), the warp of its last page through its wait 1.75 after the input
even with no stream; 2048 x 1024 (2 pages) 3.25, sums 1.75. Those traces' spans each held one read of the ns
timer (every point read it before its clock store) and their timer values were rounded to 256 ns (ns since 1970
as a double): the trace since takes the timer at the producer's two points alone, lines the SMs' clocks up by a
fit in int64 offsets, and adds each stage's first and last page summed and consumer 0's input in (TRACE_POINTS
8-10); and `test_wait` (every page's mbarrier wait a spin on test_wait, where try_wait may suspend the waiting
thread) asks whether the handshakes' 2.8 us a stage are wake-ups. Both untimed and GPU-untested: no machine
started for the session's last four asks.

Session 66: `mma_fold` (with mma_packed). mini's 4232-row stage over 132 blocks gives 8 blocks 33 rows: a third
row tile of one row, 4 pages of it at 16 KB (each summed as a whole 16-row page), and so 14 pages a layer against
a ring of 13 slots (227 KB less the static 17): those blocks' last page of the stage can only take the slot that
the stage just before it frees, through the producer; they may be each stage's last blocks (session 65's traces:
the last block's sums 4.5 us against the median's 3.5). Folded, a block's last tile of r < 16 rows is f r
virtual rows of K / f columns (row i's segment j is virtual row j r + i; f the largest up to min(8, 16 / r) that
divides K / 16): one page of 8 x 256 for that row, 11 pages a layer. The mma takes segment j's input as column j
of B and virtual row v's sum from column v / r of C. Packing and unpacking (the kernel's own arithmetic) are
CPU-tested; a lane-by-lane emulation of the consumer (a helper's review, 2,294 cases of r, K, kc and blocks) found
every row's partial sums cover its K columns once, every ldmatrix inside its slot.
Call a (H100, bench/results/2026-12-07-h100-session66.json; the whole chain ran 2.7 us a layer slower than in
session 65's H100 call, at the same clock: 13.17 for the best): the critical block is a 33-row one in every traced
configuration; folded, its stage's sums 5.05 against 5.71 us and the big stage's period 7.73 against 8.09, yet the
chain 13.14 against 13.17. test_wait no faster (13.05; the first page's wait 0.71-0.75 against 0.69-0.70). What the
mended trace showed instead: with no stream and no barrier, the first page's warp is through its wait 0.70 us after
the input though the page has long been there, and a page's sums take 1.5-2.0 us (8 KB 1.3, 32 KB 3.0: about 0.6 us
plus 65 cycles a k-block); the big stage's 8 pages sum in two rounds. The sums are most of the consumers' time.
`mma_pipelined` (written after call a): the next two k-blocks' ldmatrix issued before this two's mmas, with no
branch between (the PTX had each ldmatrix and mma in a branch-guarded block of its own).

Session 67 (H100, bench/results/2026-12-07-h100-session67.json): a9d7102's kernel beside the session's on one
machine, 10.53 against 12.3-14.0 us a layer: session 66's 2.7 us were the code. Nsight Compute's source page
(`cuda_chain_ncu.py alone`): every consumer warp walked every page of each stage to find its own, the compiler
hoisting each page's setup above the owner's test (86 instructions a page in all 15 warps, 38% of the kernel's
instructions), while the warp owning the stage's first page waited for issue slots (the trace's 0.70 us "first page
wait"); the sums themselves took 7-10% of the samples, so session 66's reading (the sums most of the time) was
wrong. A warp now steps straight to its own part-pages (next_owned, O(1)): 11.31 with mma_pipelined (12.69
without) against a9d7102's 10.52 in the same call (c); with no stream, no barrier and no sums a layer still takes
6.0 us. After call c, untimed: the block's rows of every stage in a shared table (each warp took two 64-bit
divisions a stage), a stage's pages worked out once (StagePages) and a warp's pages walked with no division but
the tile's (PageWalk), whole and unfolded tiles stored as before the fold.

Session 68 (H100, bench/results/2026-12-07-h100-session68.json): those changes correct (the tests' 151 cases) and
level with a9d7102 again: 10.55 us a layer (pipelined, folded) against its 10.52 in the same call, the launches
9.54; the consumers alone 8.33 against 8.73. Nsight Compute still found 186 instructions a warp (five 32-bit
divisions) between a stage's input barrier and its first page's wait: the stage's pages and the warp's way to its
first page, now made before the input's gather (PageWalk steps itself; the CPU test runs it). Call e, on one H100
with 6d5372b's kernel beside it: 13 instructions there, and the chain **8.71 us a layer against the 48 launches'
9.48** (x1.09; 81% of the copy rate, floor 7.09), 6d5372b's 10.46: the first chain faster than the launches.

Session 70 (H100, bench/results/2026-12-07-h100-session70.json, call f): 8.70 against a5f2ec3's 8.71 on one
machine (launches 9.47). Session 69's variants: 12 KB and 10 KB pages slower (9.28-10.28; their consumers alone
8.77 against 16 KB's 8.11: the per-page waits and stores, not a warp's chain of k-blocks), `store_first` level
(8.73). The stream alone takes 7.95 uncapped and 8.82 at the best's cap of 2 copies in flight: the best chain runs
at its capped stream's time, so what holds it now is the cap that keeps the stage's input read from queuing
behind the copies (uncapped, the chain takes 12.64).

`CudaGemvChain(weights)` takes GemvChain's layout (stage s reads the first K_s outputs of stage s - 1), at one
row, in bf16, K_s a multiple of 8 up to 2048; `depth` is how many stages past the current one a block may have
in flight (the ring of shared memory permitting: 0 copies each stage's rows only when it starts); with mma, how
many pages' copies may be in flight at once (0, or the ring's pages or more: as many as it has free slots).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from kestrel.ops import nvcc
from kestrel.ops.linear.cuda_chain_trace import TRACE_WIDTH, block_row_counts, chain_trace_summary
from kestrel.ops.linear.triton_chain import pack_chain

SOURCE = Path(__file__).with_name("cuda_chain.cu")
MAX_K = 2048  # cuda_chain.cu's kMaxUnitsPerLane x 8 x 32
MAX_DEPTH = 63  # the kernel's ring keeps the positions of 64 stages
MAX_PIPE_STAGES = 64  # cuda_chain.cu's kMaxStages: pipe's table of stages in shared memory
MAX_SPIN = 1 << 24  # polls of the counter before a block gives up (a grid not all resident)
# timing variants (cuda_chain.cu's mode bits): warp 0, the barrier's, issues no copies (a fence waits for the
# issuing thread's loads in flight); the arrival one release add instead of a fence and an add; no barrier at all
# (wrong results: the weight stream and the sums alone)
COPY_APART, RELEASE, NO_BARRIER = 1, 2, 4
# the weights as bulk copies (the TMA unit) on an mbarrier a stage; the outputs as LL pairs (value and flag in one
# 8-byte store, polled by the next stage: no counter)
TMA, LL = 8, 16
# warp 0 a producer streaming every stage's rows in pages of PAGE_BYTES through a ring of them, freed a page at a
# time by the 15 consumer warps (cuda_chain.cu's chain_pipe_kernel): the stream goes on across the stages' waits
PIPE, PAGE_BYTES = 32, 16384
# pipe's consumers only free each page (the stream alone); four producer lanes; the consumers skip their input's
# read (zeros: wrong results)
NO_COMPUTE, PRODUCERS4, NO_INPUT = 64, 128, 256
OWN_PAGES = 512  # pipe: each page waited for, summed four rows at a time and freed by one consumer warp
NO_STREAM = 1024  # pipe: pages completed without a copy (the consumers' own work alone; wrong results)
# pipe with the sums on the tensor cores: pages of 16 rows x PAGE_BYTES / 32 columns, each summed by one warp with
# mma.sync, its partial sums added a row in shared memory (K_s a multiple of 16; a block's rows of a stage times
# its pages a row at most MMA_PARTIALS)
MMA, MMA_PARTIALS = 2048, 2048
MMA_PAGE_PAD = 256  # cuda_chain.cu's mma_slot_bytes: a page's 16 rows 16 bytes apart
MMA_LANES = 4096  # mma: a page's 16 row copies issued by 16 lanes of the producer warp, not all by lane 0
MMA_PACKED = 8192  # mma: the weights packed in the producer's order (pack_mma_pages), a page one bulk copy
MMA_PARTS_SHIFT = 14  # mma: log2 of the consumer warps a page's k-blocks are split among, in mode bits 14-15
POLL_SLEEP = 1 << 16  # mma with ll: 128 ns asleep between a consumer's polls of an input pair not yet there
TEST_WAIT = (
    1 << 17
)  # mma: every wait on a page's mbarrier a spin on test_wait, not try_wait (which may suspend)
# mma_packed with a block's last row tile of r < 16 rows folded: its columns cut into f segments, each a virtual
# row of the tile, f times fewer pages (cuda_chain.cu's kMmaFold, tile_folds)
MMA_FOLD = 1 << 18
# mma_packed with a page's sums software-pipelined: the next two k-blocks' ldmatrix before this two's mmas, no
# branch between them, where a page's columns are a multiple of 64 (cuda_chain.cu's kMmaPipelined)
MMA_PIPELINED = 1 << 19
# mma with ll: the consumers meet after a stage's rows are stored, before any polls the next stage's input
# (cuda_chain.cu's kStoreFirst)
STORE_FIRST = 1 << 20
STATIC_SMEM = (
    17 * 1024
)  # cuda_chain.cu's static shared memory (the LL input, the mbarriers, pipe's stage table, mma's sums)

_lib: ctypes.CDLL | None = None
_lock = threading.Lock()
_smem_set: set[int] = set()  # devices where the kernel's shared-memory limit is set


def _load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(nvcc.build(SOURCE, nvcc.find_nvcc())))
            lib.kestrel_chain_setup.restype = ctypes.c_int
            lib.kestrel_chain_setup.argtypes = [ctypes.c_int]
            lib.kestrel_chain_launch.restype = ctypes.c_int
            lib.kestrel_chain_launch.argtypes = [
                ctypes.c_void_p,  # weights
                ctypes.c_void_p,  # activations
                ctypes.c_void_p,  # meta
                ctypes.c_int,  # stages
                ctypes.c_void_p,  # counter
                ctypes.c_void_p,  # gave_up
                ctypes.c_longlong,  # max_spin
                ctypes.c_int,  # blocks
                ctypes.c_int,  # shared memory bytes (the ring)
                ctypes.c_int,  # depth
                ctypes.c_int,  # mode (cuda_chain.cu's kCopyApart | kRelease | kNoBarrier | kTma | kLL)
                ctypes.c_void_p,  # LL pairs
                ctypes.c_longlong,  # their bytes
                ctypes.c_int,  # pipe's page bytes
                ctypes.c_void_p,  # mma's trace (null: none)
                ctypes.c_void_p,  # stream
            ]
            lib.kestrel_chain_error.restype = ctypes.c_char_p
            lib.kestrel_chain_error.argtypes = [ctypes.c_int]
            _lib = lib
    return _lib


def tile_folds(rows: int, K: int, fold: bool) -> int:
    """The segments a row tile of `rows` rows and K columns is folded into (cuda_chain.cu's tile_folds): the largest
    f <= min(8, 16 / rows) with K a multiple of 16 f, for a tile short of 16 rows; 1 without `fold`."""
    f = 1 if not fold or rows >= 16 else min(8, 16 // rows)
    while f > 1 and K % (16 * f):
        f -= 1
    return f


def pack_mma_pages(w: torch.Tensor, blocks: int, kc: int, fold: bool = False) -> torch.Tensor:
    """`w` [N, K] flat in mma_packed's order: block b's rows (N b / blocks to N (b + 1) / blocks, where they were)
    in pages of 16 rows (fewer at the block's last) x kc columns (fewer at the row's end), row tiles outer; a page's
    rows contiguous, each row's 16-byte units (8 values) swizzled: unit u of row i at u ^ (i & 7) inside each whole
    group of 8 units (cuda_chain.cu's packed_unit). Page (r0, k0) of a block starts r0 K + rows k0 values into the
    block's region, `rows` its tile's row count. With `fold` a block's last tile of r < 16 rows is f r virtual rows
    of K / f columns (tile_folds): row i's columns from j K / f on are its virtual row j r + i."""
    N, K = w.shape
    assert K % 8 == 0 and kc % 8 == 0, "16-byte units"
    dev = w.device
    r = torch.arange(N, device=dev)
    ends = torch.arange(1, blocks + 1, device=dev) * N // blocks  # block b's rows end at N (b + 1) / blocks
    b = torch.searchsorted(ends, r, right=True)  # a row's block
    first = b * N // blocks
    last = (b + 1) * N // blocks
    rb = r - first  # the row within its block
    r0 = rb // 16 * 16
    real = torch.clamp(last - first - r0, max=16)  # its tile's rows
    folds = {n: tile_folds(n, K, fold) for n in real.unique().tolist()}
    f = torch.tensor([folds[n] for n in real.tolist()], device=dev)[:, None]  # [N, 1]
    kf = K // f  # the tile's (virtual) columns
    k = torch.arange(K, device=dev)[None, :]
    j = k // kf  # the segment
    v = j * real[:, None] + (rb - r0)[:, None]  # the virtual row within its tile
    kv = k - j * kf  # the column within its segment
    k0 = kv // kc * kc
    kcp = torch.clamp(kf - k0, max=kc)  # the page's columns
    u = (kv - k0) // 8
    whole = kcp // 8 // 8 * 8
    swz = torch.where(u < whole, u ^ (v % 8), u)
    dest = ((first + r0) * K)[:, None] + (f * real[:, None]) * k0 + v * kcp + swz * 8 + k % 8
    out = torch.empty(N * K, dtype=w.dtype, device=dev)
    out[dest.reshape(-1)] = w.reshape(-1)
    return out


def _check(lib: ctypes.CDLL, err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what}: {lib.kestrel_chain_error(err).decode()}")


class CudaGemvChain:
    """Stages of GEMVs chained over static buffers, as `triton_chain.GemvChain` (fill `input` [1, K_0], call,
    read `outputs`), one block an SM (`blocks` None) or fewer, each with a ring of `ring_bytes` of shared memory
    (None: what the device allows a block); copy_apart, release, no_barrier, tma, ll and pipe: the variants
    above (pipe takes ll, no_barrier, no_compute, producers4, no_input, own_pages, no_stream and mma; its pages
    are bulk copies of page_bytes)."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        *,
        depth: int = MAX_DEPTH,
        blocks: int | None = None,
        ring_bytes: int | None = None,
        copy_apart: bool = False,
        release: bool = False,
        no_barrier: bool = False,
        tma: bool = False,
        ll: bool = False,
        pipe: bool = False,
        page_bytes: int = PAGE_BYTES,
        no_compute: bool = False,
        producers4: bool = False,
        no_input: bool = False,
        own_pages: bool = False,
        no_stream: bool = False,
        mma: bool = False,
        mma_lanes: bool = False,
        mma_packed: bool = False,
        mma_parts: int = 1,
        trace: bool = False,
        poll_sleep: bool = False,
        test_wait: bool = False,
        mma_fold: bool = False,
        mma_pipelined: bool = False,
        store_first: bool = False,
    ):
        assert weights and all(w.dim() == 2 and w.dtype == torch.bfloat16 and w.is_cuda for w in weights), (
            "weights: [N_s, K_s] bf16 on CUDA"
        )
        for w in weights:
            assert w.shape[1] % 8 == 0 and w.shape[1] <= MAX_K, (
                f"K {w.shape[1]}: a multiple of 8 up to {MAX_K}"
            )
        for prev, w in zip(weights, weights[1:]):
            assert w.shape[1] <= prev.shape[0], (
                f"stage of width {w.shape[1]} after one of {prev.shape[0]} outputs"
            )
        assert 0 <= depth <= MAX_DEPTH, f"depth {depth}: 0 to {MAX_DEPTH}"
        assert not pipe or len(weights) <= MAX_PIPE_STAGES, f"pipe takes at most {MAX_PIPE_STAGES} stages"
        self.device = weights[0].device
        props = torch.cuda.get_device_properties(self.device)
        self.blocks = blocks or props.multi_processor_count
        assert 0 < self.blocks <= props.multi_processor_count, "one block an SM at most: all must be resident"
        most = props.shared_memory_per_block_optin - STATIC_SMEM
        self.ring_bytes = (ring_bytes or most) // 16 * 16
        assert 0 < self.ring_bytes <= most, f"ring of {self.ring_bytes} bytes: at most {most} here"
        # a block's largest stage (pipe: a page)
        assert page_bytes % 16 == 0 and 0 < page_bytes, f"page of {page_bytes} bytes: a multiple of 16"
        self.page_bytes = page_bytes
        assert mma or not (mma_lanes or mma_packed), "mma_lanes and mma_packed are variants of mma"
        assert not (mma_lanes and mma_packed), "mma_packed copies a page at once: no lanes to spread"
        assert mma or not trace, "trace is mma's"
        assert mma and ll or not poll_sleep, "poll_sleep is mma's with ll"
        assert mma and ll or not store_first, "store_first is mma's with ll"
        assert mma or not test_wait, "test_wait is mma's"
        assert mma_packed and mma_parts == 1 or not mma_fold, "mma_fold is mma_packed's, with one part a page"
        assert mma_packed or not mma_pipelined, "mma_pipelined is mma_packed's"
        assert mma_parts in (1, 2, 4, 8) and (mma or mma_parts == 1), (
            f"mma_parts {mma_parts}: 1, 2, 4 or 8, with mma"
        )
        if mma:
            assert pipe, "mma is a variant of pipe"
            assert page_bytes % 512 == 0, (
                f"mma's page of {page_bytes} bytes: 16 rows of a multiple of 16 columns"
            )
            assert all(w.shape[1] % 16 == 0 for w in weights), (
                "mma: every K a multiple of 16 (mma's k-blocks)"
            )
            kc = page_bytes // 32
            partials = max(
                self._column_pages(w, kc, mma_fold) * -(-w.shape[0] // self.blocks) * mma_parts
                for w in weights
            )
            assert partials <= MMA_PARTIALS, (
                f"mma: {partials} partial sums a block a stage, at most {MMA_PARTIALS}"
            )
            page_bytes += 0 if mma_packed else MMA_PAGE_PAD
        elif pipe:
            widest = max(w.shape[1] for w in weights)
            assert page_bytes >= 2 * widest, (
                f"pipe's page of {page_bytes} bytes holds whole rows: at least {2 * widest} for K={widest}"
            )
        chunk = page_bytes if pipe else max(-(-w.shape[0] // self.blocks) * w.shape[1] * 2 for w in weights)
        assert chunk <= self.ring_bytes, (
            f"a block's rows of one stage take {chunk} bytes: ring {self.ring_bytes}"
        )
        self.depth = depth
        self.mode = (
            COPY_APART * copy_apart | RELEASE * release | NO_BARRIER * no_barrier | TMA * tma | LL * ll
        )
        self.mode |= (
            PIPE * pipe
            | NO_COMPUTE * no_compute
            | PRODUCERS4 * producers4
            | NO_INPUT * no_input
            | OWN_PAGES * own_pages
            | NO_STREAM * no_stream
            | MMA * mma
            | MMA_LANES * mma_lanes
            | MMA_PACKED * mma_packed
            | (mma_parts.bit_length() - 1) << MMA_PARTS_SHIFT
            | POLL_SLEEP * poll_sleep
            | TEST_WAIT * test_wait
            | MMA_FOLD * mma_fold
            | MMA_PIPELINED * mma_pipelined
            | STORE_FIRST * store_first
        )
        # each output 16-byte aligned: the next stage reads it in 16-byte units
        self.w, self.acts, self.meta, self.input, self.outputs = pack_chain(weights, 1, align=8)
        if mma_packed:
            self.w = torch.cat(
                [pack_mma_pages(w, self.blocks, self.page_bytes // 32, mma_fold) for w in weights]
            )
        self.sync = torch.zeros(2, dtype=torch.int32, device=self.device)  # the counter, gave_up
        self.ll = torch.zeros(
            self.acts.numel() if ll else 2, dtype=torch.int64, device=self.device
        )  # an LL pair a value
        self.stages = len(weights)
        self.shapes = [tuple(w.shape) for w in weights]
        self.trace = (
            torch.zeros(self.blocks, self.stages, TRACE_WIDTH, dtype=torch.int64, device=self.device)
            if trace
            else None
        )
        self._lib = _load()
        index = self.device.index or 0
        if index not in _smem_set:  # outside any capture: the kernel's limit, once a device, at the most
            with torch.cuda.device(self.device):
                _check(self._lib, self._lib.kestrel_chain_setup(most), "chain setup")
            _smem_set.add(index)

    def _column_pages(self, w: torch.Tensor, kc: int, fold: bool) -> int:
        """The most partial sums a row of `w` takes in a block (its tile's pages a row, times its segments)."""
        N, K = w.shape
        rows = set(block_row_counts(N, self.blocks).tolist())
        tiles = {min(16, n - r0) for n in rows for r0 in range(0, n, 16)} or {16}
        return max(-(-(K // f) // kc) * f for f in (tile_folds(t, K, fold) for t in tiles))

    def __call__(self) -> torch.Tensor:
        """Run every stage (the counter, and with ll the LL pairs, zeroed first in the same stream); the last
        stage's output."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        err = self._lib.kestrel_chain_launch(
            self.w.data_ptr(), self.acts.data_ptr(), self.meta.data_ptr(), self.stages, self.sync.data_ptr(),
            self.sync[1:].data_ptr(), MAX_SPIN, self.blocks, self.ring_bytes, self.depth, self.mode,
            self.ll.data_ptr(), self.ll.numel() * 8, self.page_bytes,
            None if self.trace is None else self.trace.data_ptr(), stream,
        )  # fmt: skip
        _check(self._lib, err, "chain launch")
        return self.outputs[-1]

    def trace_summary(self) -> dict:
        """Where the last traced call's stages went (`trace=True`), us: over every block and stage, the median
        and largest of the input's wait (start to input in), the pages' sums after it (to pages summed) and the
        stores; how far ahead of the consumers the producer had the stage's first page (free to issue at, against
        the consumers' start: above 0 ahead) and issued its last (against the input's arrival); and across the
        blocks, a stage's period (the last block's stores to the last block's stores) and the input's latency (the
        last block's stores of stage s - 1 to the last block's input in at s); and `by_class`, those of each stage
        shape on one time line (chain_trace_summary)."""
        assert self.trace is not None, "trace=True"
        return chain_trace_summary(self.trace, self.shapes)

    def gave_up(self) -> bool:
        """Whether a block gave up waiting at the counter in a call so far (its results are wrong)."""
        return bool(self.sync[1].item())
