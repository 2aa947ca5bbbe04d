"""Exact row-wise top-k for DSA as one CUDA kernel (cuda_topk.cu): `topk_cuda(scores, lens, k)` returns what
`triton_topk.topk_triton(scores, lens, k)` returns, bit for bit.

The contract. scores [B, L] fp32 (any row stride), lens [B] int32 or int64, clamped to [0, L]: positions
0..lens[b]-1 are valid, a NaN or a later position is invalid. Keys order as the floats with -0.0 == +0.0,
+inf above every finite score, a valid -inf below every finite score and above every invalid position; ties go
to the lower position. The selection is the first min(k, valid) elements of (key desc, position asc), listed in
ascending position order, then -1. Returns [B, k] int64 (into `out` when given). No host syncs: the kernel runs
on torch's current stream and is CUDA-graph capturable (the first call on a device must come before a capture:
it sets the kernel's shared-memory limit; inside a capture it raises instead).

The algorithm (the .cu file's header has the details): one block per row (1024 threads; 256 or 512 for rows up
to 8704 wide, variants 3 and 4, whose 1024 threads mostly wait at the barriers), radix select on the
32-bit key in 11 + 11 + 10 bits. The row is read once for a 2048-bin shared histogram of the top 11 bits, and
once more (mostly from L2) to copy the keys at or above the threshold digit to shared memory in position order;
the last two digits and the final selection work on that copy. Rows whose threshold digit holds more than the
shared-memory capacity (24576 candidates on the H200; heavy ties, an all-equal row) take one or two more
digits from the row instead (never when L <= the capacity). Any k >= 1 works: the output is written straight
to global memory. Variant 9 splits each row of at least CLUSTER_MIN_L valid scores over a cluster of two
blocks (compute capability 9.0+; a shorter row is done by the first block alone), which `topk_cuda` picks for
few wide rows (`choose_variant`). Where the Triton kernels launch with programmatic
dependent launch (kestrel.ops.pdl: Hopper), so does this one: it may start while the indexer's scores kernel
ends, and waits for it before its first read.

Short rows in registers (variants 5-8, cuda_topk.cu's `topk_short_kernel<NT, V>`): one block of NT threads a
row of at most NT * V 16-byte slots (ROW_SLOTS: 4096 or 8192 scores when the row pointer is 16-byte aligned,
up to 3 fewer when not), each thread holding 4 V consecutive scores as keys in registers. The row is read once, T
comes from four 8-bit digits of 256 shared bins each, a warp's adds to one bin merged into one atomic, and one
block scan gives the output ranks. They are for decode's short rows, where variants 0-4 spend their time on
shared atomics to the one or two bins that the first 11-bit digit puts nearly the whole row into, and on the
candidate copy and its histograms, which a row that fits in registers does not need. On the H100 (session 58,
scripts/topk_cuda_check.py's rows_sweep) one row of 4096 took 9.7 us against 13.2, mini's 4224-wide row 11.5
against 13.4; `choose_variant` picks one for up to 256 rows that fit (KESTREL_DSA_TOPK_REGISTERS, on by
default). A variant refuses scores with a row wider than it takes (`variant_takes`).

Pool rows from the same launch (`topk_cuda(rows=)`, `topk_cuda_with_rows`): each short variant has a twin that
also writes every selected position's pool row through the paged cache's page table (page_table[b, pos //
page_size] * page_size + pos % page_size, int32, -1 where the index is -1: what triton_decode's `selected_rows`
computes in a launch of its own before the sparse MLA decode). The decode layer takes them with
KESTREL_DSA_TOPK_ROWS=on (off by default: the same bits, but mini's batch-1 step 0.7-1.0% slower on the H100,
session 59); a pick that is not a short variant writes none, and the
caller translates the indices as before.

Measured on the H200 (scripts/topk_cuda_check.py, 2026-12-01, session 19,
bench/results/2026-12-01-topk-cuda-h200-session19.json): every variant matched naive.topk_select on all 59
cases and topk_triton on all compared. [64, 131072] fp32, k = 2048, L2 flushed: topk_cuda (its pick, the
cluster) 43.2 us for randn, 46.5 for a ramp, 50.6 for heavy ties, against torch.topk's 192.5-196.0 us (4.46x,
4.17x, 3.87x) and topk_triton's 134-159; variant 0 alone 57.7 / 59.1 / 72.0 us. At the prefill and training
shapes (4096 rows) variant 0 takes 0.68x and 0.55x topk_triton's time, the cluster 2.5x variant 0's.

Build: on first use nvcc compiles cuda_topk.cu for the device's compute capability into
$KESTREL_CACHE_DIR/cuda (default ~/.cache/kestrel/cuda), one file per hash of the source, the arch and the
nvcc version and the flags, and ctypes loads it; a probe (8 scores, k = 3) then checks that the kernel runs
and answers right (a library built by a newer CUDA than the driver's loads, then fails every launch).
`available()` says whether all that worked; `UNAVAILABLE_REASON` says why not.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from kestrel.env import env_field
from kestrel.ops import nvcc
from kestrel.ops.nvcc import FLAGS, find_nvcc
from kestrel.ops.pdl import pdl_args

SOURCE = Path(__file__).with_name("cuda_topk.cu")
MAX_L = 2**31 - 2**20  # positions are int32 in the kernel, with headroom for the last chunk's slot indices
# The kernel variants (cuda_topk.cu's VARIANTS: 0 = one histogram copy, plain gather; 1 = four lane-picked
# copies of each histogram bin; 2 = those and the gather's loads prefetched a chunk ahead; 3 and 4 = 0 with 256
# and 512 threads a row; 5-8 = short rows in registers, (threads, 16-byte slots a thread) = (512, 2), (1024, 2),
# (512, 4), (256, 8); 9 = 0 with a two-block cluster a row). All give the same result on the rows they take;
# scripts/topk_cuda_check.py checks and times each. topk_cuda runs DEFAULT_VARIANT, or another where
# `choose_variant` says so.
DEFAULT_VARIANT = 0
SHORT_VARIANT, MEDIUM_VARIANT = 3, 4  # 256 and 512 threads a row
SHORT_MAX_L = 6144  # rows at most this wide take SHORT_VARIANT
MEDIUM_MAX_L = 8704  # up to this width: SHORT_VARIANT for more rows than SMs, else MEDIUM_VARIANT
# The short variants' widest row, in 16-byte slots (cuda_topk.cu's ROW_SLOTS; the other variants take any width)
ROW_SLOTS = {5: 512 * 2, 6: 1024 * 2, 7: 512 * 4, 8: 256 * 8}
# choose_variant's pick of a short variant, for up to REGISTER_MAX_B rows (decode's batches; prefill's thousands
# keep the timed SHORT_VARIANT): rows of at most 1024 slots (4096 scores) REGISTER_NARROW (512 threads x 2 slots);
# up to 2048 slots (8192 scores) REGISTER_WIDE_FEW (1024 x 2) for up to REGISTER_FEW_B rows, REGISTER_WIDE_MANY
# (512 x 4) above (the H100 sweep of session 58 in choose_variant's docstring). REGISTER_PICKS are probed before
# any is picked. KESTREL_DSA_TOPK_REGISTERS=off leaves every pick as before the short variants (each still runs by
# `variant=`).
REGISTER_NARROW, REGISTER_WIDE_FEW, REGISTER_WIDE_MANY = 5, 6, 7
REGISTER_PICKS = (REGISTER_NARROW, REGISTER_WIDE_FEW, REGISTER_WIDE_MANY)
REGISTER_FEW_B = 64
REGISTER_MAX_B = 256
CLUSTER_VARIANT = 9
CLUSTER_MIN_L = 32768  # rows at least this wide take the cluster variant while it has an SM per block

UNAVAILABLE_REASON: str | None = None  # why available() is False; None while it is True or not yet asked
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
# devices whose kernel shared-memory limits are set (kestrel_topk_setup) and whose default variant passed its
# probe: index -> (SM count, whether the cluster variant runs there and passed its probe, whether every one of
# REGISTER_PICKS passed its probe)
_ready: dict[int, tuple[int, bool, bool]] = {}
_ready_lock = threading.RLock()  # re-entered: a probe launches through _launch, which asks _prepare
# device index -> why choose_variant never picks the cluster there
CLUSTER_UNAVAILABLE_REASON: dict[int, str] = {}
# device index -> why choose_variant never picks a short variant there (one of REGISTER_PICKS failed its probe)
REGISTER_UNAVAILABLE_REASON: dict[int, str] = {}


def build(verbose: bool = False) -> Path:
    """Compile cuda_topk.cu for the current device (cached) and return the shared library's path."""
    return nvcc.build(SOURCE, find_nvcc(), FLAGS, verbose)


def _load() -> ctypes.CDLL | None:
    """The kernel library, built and loaded once per process; None (and UNAVAILABLE_REASON) when it cannot be."""
    global _lib, _tried, UNAVAILABLE_REASON
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device")
            lib = ctypes.CDLL(str(build()))
            _declare(lib)
            _prepare(lib, torch.device("cuda", torch.cuda.current_device()))  # raises if the default fails
            _lib, UNAVAILABLE_REASON = lib, None
        except Exception as e:  # noqa: BLE001 - any failure means "use another backend", with the reason kept
            _lib, UNAVAILABLE_REASON = None, f"{type(e).__name__}: {e}"
        _tried = True
    return _lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The library's C functions' argument and result types (kestrel_topk_launch's are its ABI: cuda_topk.cu's
    extern "C" signature, argument for argument)."""
    lib.kestrel_topk_launch.restype = ctypes.c_int
    lib.kestrel_topk_launch.argtypes = [
        ctypes.c_void_p,  # scores
        ctypes.c_longlong,  # row stride of scores
        ctypes.c_int,  # B
        ctypes.c_int,  # L
        ctypes.c_void_p,  # lens
        ctypes.c_int,  # lens are int64
        ctypes.c_int,  # k
        ctypes.c_void_p,  # out
        ctypes.c_longlong,  # row stride of out
        ctypes.c_void_p,  # page table (pool rows; null without them)
        ctypes.c_int,  # the page table is int64
        ctypes.c_longlong,  # row stride of the page table
        ctypes.c_int,  # page size
        ctypes.c_void_p,  # rows_out (null: no pool rows)
        ctypes.c_longlong,  # row stride of rows_out
        ctypes.c_void_p,  # cudaStream_t
        ctypes.c_int,  # kernel variant
        ctypes.c_int,  # programmatic dependent launch
    ]
    lib.kestrel_topk_setup.restype = ctypes.c_int
    lib.kestrel_topk_num_variants.restype = ctypes.c_int
    lib.kestrel_topk_row_slots.restype = ctypes.c_int
    lib.kestrel_topk_row_slots.argtypes = [ctypes.c_int]
    lib.kestrel_topk_error.restype = ctypes.c_char_p
    lib.kestrel_topk_error.argtypes = [ctypes.c_int]
    return lib


def _prepare(lib: ctypes.CDLL, device: torch.device) -> tuple[int, bool, bool]:
    """Once per device, outside any CUDA graph capture: set every kernel variant's shared-memory limit, probe the
    default variant (raises when it fails), then the short variants of REGISTER_PICKS and the cluster variant
    (each only picked where its probes passed; REGISTER_UNAVAILABLE_REASON and CLUSTER_UNAVAILABLE_REASON keep
    why not). Returns (the device's SM count, whether the cluster variant can be chosen, whether the short
    variants can be)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _ready:
        return _ready[index]
    with _ready_lock:
        if index in _ready:
            return _ready[index]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"topk_cuda: call it once on cuda:{index} before capturing a CUDA graph there")
        with torch.cuda.device(index):
            err = lib.kestrel_topk_setup()
            if err != 0:
                raise RuntimeError(
                    f"topk_cuda setup on cuda:{index} failed: {lib.kestrel_topk_error(err).decode()}"
                )
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            _ready[index] = (sms, False, False)  # set up: the probes below launch through _launch
            failure = _probe(lib, index, DEFAULT_VARIANT)
            if failure is not None:
                del _ready[index]
                raise RuntimeError(failure)
            registers = True
            for variant in REGISTER_PICKS:
                if (failure := _probe(lib, index, variant)) is not None:
                    REGISTER_UNAVAILABLE_REASON[index] = failure
                    registers = False
                    break
            cluster = False
            if lib.kestrel_topk_num_variants() <= CLUSTER_VARIANT:
                CLUSTER_UNAVAILABLE_REASON[index] = "compute capability below 9.0 (no thread-block clusters)"
            elif (failure := _probe(lib, index, CLUSTER_VARIANT)) is not None:
                CLUSTER_UNAVAILABLE_REASON[index] = failure
            else:
                cluster = True
            _ready[index] = (sms, cluster, registers)
    return _ready[index]


def variant_for(B: int, L: int, device: torch.device, slots: int | None = None) -> int:
    """The variant topk_cuda runs for B rows of width L spanning `slots` 16-byte slots (`row_slots` of the
    scores; None: unknown, no short variant) on `device` (`choose_variant` with the device's SM count and
    whether its cluster and short-variant probes passed); sets the device up on first use (outside a graph
    capture)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"topk_cuda is unavailable: {UNAVAILABLE_REASON}")
    sms, cluster, registers = _prepare(lib, device)
    return choose_variant(B, L, sms, cluster, slots if registers else None)


def _probe(lib: ctypes.CDLL, index: int, variant: int) -> str | None:
    """Run `variant` once on 8 known scores on cuda:`index`: None when it answers right, else what went wrong."""
    scores = torch.tensor([[3.0, 1.0, 2.0, 5.0, 4.0, 0.0, -1.0, 7.0]], device=f"cuda:{index}")
    lens = torch.tensor([8], device=scores.device)
    out = torch.full((1, 3), -7, dtype=torch.int64, device=scores.device)
    try:
        _launch(lib, scores, lens, 3, out, variant)
        got = out.tolist()
    except RuntimeError as e:
        return str(e)
    return (
        None if got == [[3, 4, 7]] else f"the kernel's probe (variant {variant}) gave {got}, not [[3, 4, 7]]"
    )


def choose_variant(B: int, L: int, sms: int, cluster: bool, slots: int | None = None) -> int:
    """The kernel variant for B rows of L scores on a device of `sms` SMs, whose widest row spans `slots` 16-byte
    slots (`row_slots`; None: unknown, or the short variants failed their probes): with KESTREL_DSA_TOPK_REGISTERS
    at auto (the default), at most REGISTER_MAX_B rows and rows that fit a short variant, REGISTER_NARROW for rows
    of at most 1024 slots, else REGISTER_WIDE_FEW for up to REGISTER_FEW_B rows and REGISTER_WIDE_MANY above; else
    the two-block cluster (when the device runs it) while every block has an SM of its own
    (2 B <= sms) and rows are wide enough for a second block to pay (L >= CLUSTER_MIN_L); 256 threads a row for
    short rows (L <= SHORT_MAX_L), and up to MEDIUM_MAX_L where there are more rows than SMs, else 512 there;
    else the default (1024). L is the scores' width (decode's graphs pad it to the longest context the engine
    takes, so a short row in a wide buffer takes the choice of the wide one; the cluster variant then does a row
    of fewer than CLUSTER_MIN_L valid scores in one block, as the default does: cuda_topk.cu's SPLIT_MIN_N).
    Host-only: no device sync, graph safe.
    On the H200 (session 24; the sweep's source and figures: bench/results/2026-12-01-h200-session24.json),
    k = 2048, randn, L2 flushed, us for 1024 / 512 / 256 threads a row: 256 rows of 4096 30.6 / 25.2 / 19.7, 1
    row 15.6 / 12.6 / 12.5; 256 rows of 8192 32.0 / 26.8 / 23.4, 64 rows 16.7 / 14.0 / 17.7; prefill's 4096 rows
    of 4096 283 / 226 / 119, training's 4096 x 8704 (k = 256) 370 / 298 / 222; from 16384 wide 256 threads lose
    (256 rows 34.6 / 34.5 / 45.7, 4096 rows of 32768 624 / 718 / 1081) and 512 do not win.
    On the H200 (132 SMs; scripts/topk_cuda_check.py rows_sweep, 2026-12-01, session 19), k = 2048, full rows,
    cluster vs variant 0: 1 row of 16384 21.2 vs 18.1 us, of 32768 21.6 vs 23.7, of 131072 36.9 vs 54.4; 64
    rows of 32768 24.0 vs 24.8, of 131072 43.1 vs 57.8; 128 rows of 131072 78.6 vs 69.0. A row of 4096 valid
    scores in a 131072-wide buffer: 20.0 vs 16.9 us (the cost of deciding by width, before the cluster variant
    did such rows in one block).
    The short variants on the H100 (session 58, bench/results/2026-12-06-h100-session58.json; rows_sweep, k = 2048,
    randn, L2 flushed, us, all equal to the reference): rows of 4096 at 1 / 4 / 64 / 256 rows: 512 x 2 (variant 5)
    9.7 / 10.7 / 11.1 / 16.4 against variant 3's 13.2 / 13.4 / 14.3 / 20.5; mini's 4224 wide: 1024 x 2 (6) 11.5 /
    12.5 / 13.1 / 23.1, 512 x 4 (7) 12.4 / 13.5 / 14.0 / 19.9 against the old picks' 13.4 / 13.6 / 14.2 / 22.6;
    4096 valid scores in an 8192-wide buffer (a short graph at 4K) 11.2 / 11.1 / 12.8 / 22.3 and 11.7 / 12.1 /
    13.3 / 19.3 against 13.0 / 13.4 / 13.9 / 20.9; full rows of 8192 are the one loss: 14.0 / 15.3 / 17.0 / 30.6
    and 14.0 / 15.4 / 17.2 / 25.7 against 13.5 / 13.8 / 15.0 / 24.8."""
    if slots is not None and B <= REGISTER_MAX_B and env_field("dsa_topk_registers") == "auto":
        if slots <= ROW_SLOTS[REGISTER_NARROW]:
            return REGISTER_NARROW
        if slots <= ROW_SLOTS[REGISTER_WIDE_FEW]:
            return REGISTER_WIDE_FEW if B <= REGISTER_FEW_B else REGISTER_WIDE_MANY
    if cluster and L >= CLUSTER_MIN_L and 2 * B <= sms:
        return CLUSTER_VARIANT
    if L <= SHORT_MAX_L or (L <= MEDIUM_MAX_L and B > sms):
        return SHORT_VARIANT
    if L <= MEDIUM_MAX_L:
        return MEDIUM_VARIANT
    return DEFAULT_VARIANT


def row_slots(scores: torch.Tensor) -> int:
    """The 16-byte slots the widest row of scores [B, L] (fp32, unit column stride) spans, as cuda_topk.cu's
    launcher counts them: L scores after the row's head, the 0-3 scores between the 16-byte boundary at or before
    its first score and that score. Every row has the first row's head when the row stride is a multiple of 4
    scores (or there is one row); else up to 3 is assumed."""
    B, L = scores.shape
    if B <= 1 or scores.stride(0) % 4 == 0:
        head = (scores.data_ptr() // 4) % 4
    else:
        head = 3
    return (L + head + 3) // 4


def variant_takes(variant: int, scores: torch.Tensor) -> bool:
    """Whether kernel `variant` takes scores [B, L] (fp32, unit column stride): every variant but the short ones
    (ROW_SLOTS) takes any width; a short one takes rows of at most ROW_SLOTS[variant] slots (`row_slots`), so
    4096 (or 8192) scores from a 16-byte aligned row pointer, up to 3 fewer from any other."""
    return variant not in ROW_SLOTS or row_slots(scores) <= ROW_SLOTS[variant]


def available() -> bool:
    """Whether topk_cuda can run here (a CUDA device, nvcc, a successful build and probe); never raises (`_load`
    keeps any failure as UNAVAILABLE_REASON)."""
    return _load() is not None


def num_variants() -> int:
    """How many kernel variants the library has (0 when unavailable)."""
    lib = _load()
    return 0 if lib is None else lib.kestrel_topk_num_variants()


def topk_cuda(
    scores: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    out: torch.Tensor | None = None,
    *,
    variant: int | None = None,
    rows: tuple[torch.Tensor, int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Exact top-k of each row of scores [B, L] fp32 over its first lens[b] positions (lens [B] int32/int64).

    Returns indices [B, k] int64: the positions `naive.topk_select(scores, lens - 1, k)` selects, in ascending
    position order, then -1; the same tensor `topk_triton(scores, lens, k)` returns. `out` [B, k] int64 with unit
    column stride, when given, receives the result. `variant` picks the kernel variant (for measurements; a
    ValueError when it does not take the scores' rows, `variant_takes`); None: `choose_variant`'s pick for the
    shape.
    rows = (page_table, page_size, rows_out): the same launch also writes each selected position's pool row to
    rows_out [B, k] int32 (what `triton_decode.selected_rows(indices, page_table, page_size, lens)` returns; -1
    where indices has -1); `check_rows` says what it takes. Only a short variant (ROW_SLOTS) writes them: a
    ValueError for any other, picked or asked for (`topk_cuda_with_rows` falls back instead).
    """
    out, _ = _topk(scores, lens, k, out, variant, rows, strict=True)
    return out


def topk_cuda_with_rows(
    scores: torch.Tensor,
    lens: torch.Tensor,
    k: int,
    page_table: torch.Tensor,
    page_size: int,
    out: torch.Tensor | None = None,
    rows_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`topk_cuda(scores, lens, k, out)` and, where its pick (`choose_variant`) is a short variant, the selected
    positions' pool rows from the same launch: (indices [B, k] int64, rows [B, k] int32 into rows_out, or a new
    tensor). Where the pick is another variant the top-k runs alone and rows is None: the caller translates the
    indices itself (`selected_rows`). The pick depends on the shapes and the scores' 16-byte alignment only, never
    on their values (CUDA-graph safe). page_table [B, pages] int32 or int64 with unit column stride covering
    every position (pages * page_size >= L; `check_rows`)."""
    return _topk(scores, lens, k, out, None, (page_table, page_size, rows_out), strict=False)


def check_rows(
    rows, B: int, L: int, k: int, device: torch.device, make_out: bool = False
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """topk_cuda's `rows` = (page_table, page_size, rows_out) checked for B rows of L scores, k selected, on
    `device` (a ValueError saying what is wrong): page_table [B, pages] int32 or int64 on `device`, unit column
    stride (any row stride, 0 included: an expanded row), pages * page_size >= L (the page of every position the
    kernel may select); page_size an int, 1 <= page_size < 2^31; rows_out [B, k] int32 on `device` with unit
    column stride (None only with make_out: `topk_cuda_with_rows` makes it). Returns them as given. Host-only."""
    if not (isinstance(rows, tuple | list) and len(rows) == 3):
        raise ValueError("topk_cuda: rows must be (page_table, page_size, rows_out)")
    table, page_size, rows_out = rows
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size < 2**31:
        raise ValueError(f"topk_cuda: page_size must be an int from 1 to 2^31 - 1, got {page_size!r}")
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] != B:
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"topk_cuda: page_table must be [{B}, pages], got {shape}")
    if table.dtype not in (torch.int32, torch.int64) or table.device != device:
        raise ValueError(
            f"topk_cuda: page_table must be int32 or int64 on {device}, got {table.dtype} on {table.device}"
        )
    if table.shape[1] > 1 and table.stride(1) != 1:
        raise ValueError(f"topk_cuda: page_table needs unit column stride, got strides {table.stride()}")
    if table.shape[1] * page_size < L:
        raise ValueError(
            f"topk_cuda: page_table's {table.shape[1]} pages of {page_size} cover {table.shape[1] * page_size} "
            f"positions, the scores {L}"
        )
    if rows_out is None and not make_out:
        raise ValueError("topk_cuda: rows need rows_out, [B, k] int32 (topk_cuda_with_rows makes one)")
    if rows_out is not None and (
        not isinstance(rows_out, torch.Tensor)
        or rows_out.shape != (B, k)
        or rows_out.dtype != torch.int32
        or rows_out.stride(-1) != 1
        or rows_out.device != device
    ):
        raise ValueError(f"topk_cuda: rows_out must be [{B}, {k}] int32 on {device} with unit column stride")
    return table, page_size, rows_out


def _topk(scores, lens, k, out, variant, rows, strict: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """topk_cuda's checks and launch; with rows, its pool rows too where the variant is a short one (else a
    ValueError when `strict`, or no rows: None in their place)."""
    B, L = scores.shape
    if scores.dtype != torch.float32 or not scores.is_cuda:
        raise ValueError(f"topk_cuda needs fp32 CUDA scores, got {scores.dtype} on {scores.device}")
    if lens.shape != (B,) or lens.device != scores.device:
        raise ValueError(f"lens {tuple(lens.shape)} on {lens.device}: expected {(B,)} on {scores.device}")
    if not (1 <= k < 2**31 and L <= MAX_L and B < 2**31):
        raise ValueError(
            f"topk_cuda: k = {k}, scores {tuple(scores.shape)}: needs 1 <= k < 2^31, L <= {MAX_L}"
        )
    if out is None:
        out = torch.empty(B, k, dtype=torch.int64, device=scores.device)  # [B, k]
    if out.shape != (B, k) or out.dtype != torch.int64 or out.stride(-1) != 1 or out.device != scores.device:
        raise ValueError(f"out must be [{B}, {k}] int64 on {scores.device} with unit column stride")
    if rows is not None:
        rows = check_rows(rows, B, L, k, scores.device, make_out=not strict)
    rows_out = None
    if B == 0 or L == 0:  # nothing to launch: no scores, every entry -1
        if rows is not None:
            rows_out = (
                rows[2] if rows[2] is not None else torch.empty(B, k, dtype=torch.int32, device=out.device)
            )
            rows_out.fill_(-1)
        return out.fill_(-1), rows_out
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if variant is not None and not variant_takes(variant, scores):
        raise ValueError(
            f"topk_cuda: variant {variant} takes rows of at most {ROW_SLOTS[variant]} 16-byte slots "
            f"({4 * ROW_SLOTS[variant]} scores from a 16-byte aligned row pointer, up to 3 fewer from another); "
            f"scores {tuple(scores.shape)} with row stride {scores.stride(0)} span {row_slots(scores)}"
        )
    if rows is not None and variant is not None and variant not in ROW_SLOTS:
        raise ValueError(
            f"topk_cuda: variant {variant} writes no pool rows (only the short ones, {sorted(ROW_SLOTS)})"
        )
    if lens.dtype not in (torch.int32, torch.int64):
        lens = lens.to(torch.int64)
    lens = lens.contiguous()
    lib = _load()
    if lib is None:
        raise RuntimeError(f"topk_cuda is unavailable: {UNAVAILABLE_REASON}")
    if variant is None:  # variant_for's pick
        sms, cluster, registers = _prepare(lib, scores.device)
        variant = choose_variant(B, L, sms, cluster, row_slots(scores) if registers else None)
    if rows is not None and variant not in ROW_SLOTS:
        if strict:
            raise ValueError(
                f"topk_cuda: the pick for scores {tuple(scores.shape)}, variant {variant}, writes no pool rows "
                f"(only the short ones, {sorted(ROW_SLOTS)}, do: KESTREL_DSA_TOPK_REGISTERS=auto, up to "
                f"{REGISTER_MAX_B} rows of at most {4 * max(ROW_SLOTS.values())} scores)"
            )
        rows = None
    if rows is not None:
        table, page_size, rows_out = rows
        if rows_out is None:
            rows_out = torch.empty(B, k, dtype=torch.int32, device=scores.device)  # [B, k]
        rows = (table, page_size, rows_out)
    _launch(lib, scores, lens, k, out, variant, rows)
    return out, rows_out


def _launch(lib: ctypes.CDLL, scores, lens, k: int, out, variant: int, rows=None) -> None:
    """One launch on torch's current stream (arguments checked by topk_cuda; the probe's are known good), with
    programmatic dependent launch where the Triton kernels have it (kestrel.ops.pdl): the kernel may start while
    the indexer's scores kernel ends, and waits for it before its first read. rows: (page_table, page_size,
    rows_out) as `check_rows` leaves them (a short variant's twin writes the pool rows), or None."""
    _prepare(lib, scores.device)
    B, L = scores.shape
    table, page_size, rows_out = rows if rows is not None else (None, 1, None)
    with torch.cuda.device(scores.device):
        err = lib.kestrel_topk_launch(
            scores.data_ptr(),
            scores.stride(0),
            B,
            L,
            lens.data_ptr(),
            int(lens.dtype == torch.int64),
            k,
            out.data_ptr(),
            out.stride(0),
            None if table is None else table.data_ptr(),
            int(table is not None and table.dtype == torch.int64),
            0 if table is None else table.stride(0),
            page_size,
            None if rows_out is None else rows_out.data_ptr(),
            0 if rows_out is None else rows_out.stride(0),
            torch.cuda.current_stream().cuda_stream,
            variant,
            int(bool(pdl_args(scores))),
        )
    if err != 0:
        raise RuntimeError(f"topk_cuda launch failed: {lib.kestrel_topk_error(err).decode()}")
