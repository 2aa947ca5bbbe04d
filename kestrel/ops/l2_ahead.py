"""Weights asked into L2 ahead of the kernels that read them, from a side stream: an experiment for decode at a
few rows (KESTREL_L2_AHEAD=on; off by default until timed on a GPU).

Why: at batch 1 a decode step's kernels read their weights from HBM just in time. Each GEMV asks its own slice
into L2 before its PDL wait (kestrel.ops.linear.triton_gemv), which overlaps only the tail of the kernel before.
On the H200 the 48 projections took 0.345 ms a step against 0.176 ms of bytes at the copy rate, and the one-launch
MoE 17.4 us a layer against 5.3 (session 46). `scripts/decode_kernels_check.py --sections l2_ahead` measures the
ceiling of prefetching (a chain of projections whose weights stay in L2) and a paced side stream on a GEMV chain.
This module puts that side stream into the decode step.

`L2Ahead.ask(tensors)` records an event on the current stream and has the side stream, once the event has
passed, ask `tensors`' bytes into L2 (one `_ask_kernel` launch: each lane a bulk prefetch of CHUNK bytes,
sm_90+; nothing waits for the data). The model (kestrel.models.kimi) asks, where the ForwardContext holds an
`L2Ahead` (`extras["l2_ahead"]`, set by the runner for decode steps of at most MAX_ROWS rows): before layer i's
attention, layer i's MLP weights other than the routed experts (its router and shared expert, read ~20-30 us
later); before layer i's MLP, layer i + 1's attention weights (read after the MoE's ~17 us); at most MAX_BYTES an
ask, in the order the layer reads them (an MLA layer's projections are 43 MB: L2 holds 50). `join()` makes
the current stream wait for the side stream (a CUDA graph's capture must end joined). Prefetches change no
value: the step's outputs are the same bits with or without them.

Legend: CHUNK bytes a lane, LANES lanes a program; SEGS tensors an ask (up to MAX_SEGMENTS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.env import env_field
from kestrel.ops.pdl import l2_prefetch, pdl_on

MAX_ROWS = 16  # decode steps of at most this many rows ask ahead (the GEMV's rows: where weights dominate)
MAX_BYTES = 24 << 20  # bytes an ask takes at most, its tensors in order (L2: 50 MB on the H200)
MAX_SEGMENTS = 8  # tensors an ask takes at most (one launch)
MIN_BYTES = 1 << 16  # smaller weights (norms, biases) are not asked for
CHUNK = 4096  # bytes a lane asks for (one bulk prefetch; the GEMV's rows are 2-8 KB)
LANES = 64  # lanes a program (two warps: a lane a thread)


@triton.jit
def _segment(s: tl.constexpr, pid_s, base, nbytes, b, n):
    """Segment s's base and byte count where it is the program's (pid_s == s)."""
    take = pid_s == s
    return tl.where(take, b, base), tl.where(take, n, nbytes)


@triton.jit
def _ask_kernel(
    b0, n0, b1, n1, b2, n2, b3, n3, b4, n4, b5, n5, b6, n6, b7, n7,
    CHUNK: tl.constexpr, LANES: tl.constexpr, SEGS: tl.constexpr,
):  # fmt: skip
    """Program (c, s): chunks c * LANES .. + LANES - 1 of segment s (a uint8 view of one tensor, nbytes a
    multiple of 16), each a bulk prefetch into L2. Lanes past the segment's end ask for its last chunk again (the
    instruction takes no mask; a second ask of a line in L2 costs nothing)."""
    pid_s = tl.program_id(1)
    base, nbytes = b0, n0
    if SEGS > 1:
        base, nbytes = _segment(1, pid_s, base, nbytes, b1, n1)
    if SEGS > 2:
        base, nbytes = _segment(2, pid_s, base, nbytes, b2, n2)
    if SEGS > 3:
        base, nbytes = _segment(3, pid_s, base, nbytes, b3, n3)
    if SEGS > 4:
        base, nbytes = _segment(4, pid_s, base, nbytes, b4, n4)
    if SEGS > 5:
        base, nbytes = _segment(5, pid_s, base, nbytes, b5, n5)
    if SEGS > 6:
        base, nbytes = _segment(6, pid_s, base, nbytes, b6, n6)
    if SEGS > 7:
        base, nbytes = _segment(7, pid_s, base, nbytes, b7, n7)
    last = (nbytes - 1) // CHUNK  # the segment's last chunk
    if tl.program_id(0) * LANES <= last:  # programs past a shorter segment's end ask nothing
        chunk = tl.minimum(tl.program_id(0) * LANES + tl.arange(0, LANES), last).to(tl.int64)
        offset = chunk * CHUNK
        size = tl.minimum(nbytes - offset, CHUNK).to(tl.int32)  # the last chunk's rest: a multiple of 16
        l2_prefetch(base + offset, size)


def segments(tensors: list[torch.Tensor], max_bytes: int = MAX_BYTES) -> list[tuple[torch.Tensor, int]]:
    """(uint8 view, bytes to ask) of each tensor in order while the budget lasts: the last one taken may be cut
    short, and a tensor's byte count is rounded down to a multiple of 16 (the prefetch's unit). Contiguous
    tensors on 16-byte addresses only; the others are skipped (none of the model's weights)."""
    out, left = [], max_bytes
    for t in tensors:
        if left < 16 or len(out) == MAX_SEGMENTS:
            break
        if not t.is_contiguous() or t.data_ptr() % 16:
            continue
        nbytes = min(t.numel() * t.element_size(), left) // 16 * 16
        if nbytes:
            out.append((t.reshape(-1).view(torch.uint8), nbytes))
            left -= nbytes
    return out


def supported(device: torch.device) -> bool:
    """KESTREL_L2_AHEAD on, a CUDA device where PDL is on (Hopper and later: the bulk prefetch is sm_90)."""
    return env_field("l2_ahead") == "on" and pdl_on(device)  # the variable first: a bad value is an error


class L2Ahead:
    """A side stream asking weights into L2 as the current stream passes each ask (see the module docstring).
    `asked` counts the asks since the last `join` (the tests read it)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.asked = 0

    def ask(self, tensors: list[torch.Tensor]) -> None:
        segs = segments(tensors)
        if not segs:
            return
        passed = torch.cuda.Event()
        passed.record(torch.cuda.current_stream())
        self.stream.wait_event(passed)
        chunks = max(-(-n // CHUNK) for _, n in segs)
        padded = segs + [segs[0]] * (MAX_SEGMENTS - len(segs))  # never read past SEGS (len(segs))
        args = [a for seg in padded for a in seg]
        with torch.cuda.stream(self.stream):
            _ask_kernel[(-(-chunks // LANES), len(segs))](
                *args, CHUNK=CHUNK, LANES=LANES, SEGS=len(segs), num_warps=LANES // 32
            )
        self.asked += 1

    def join(self) -> None:
        """The current stream waits for every ask so far."""
        if self.asked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.asked = 0
