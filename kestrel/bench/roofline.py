"""The ceilings every GPU figure is reported against, measured in the same run: device-to-device copy
bandwidth (bytes read + written) and a large bf16 matmul rate (and, for decode, the time one dependent launch
costs in a CUDA graph); and median timers for GPU work (queued calls, or calls replayed from one CUDA graph as
decode runs them).

Other devices (the CPU smoke run of scripts/gpu_suite.py) get small sizes and a wall-clock timer: the same
code runs, the figures mean nothing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# Timed calls of `time_ms` off the GPU (after one warm-up where more than one). The smoke runs of the GPU scripts
# (`--smoke`: their code on the CPU under Triton's interpreter, where no figure means anything) set it to 1.
CPU_TIMED_CALLS = 3


def time_ms(
    fn: Callable[[], object], device: str = "cuda", warmup_ms: float = 25, rep_ms: float = 100
) -> float:
    """Median milliseconds of `fn` on the GPU (triton's do_bench: iterations queued back to back with CUDA
    events, the L2 cache flushed before each, so a small working set is not read from cache); on another
    device, the wall-clock median of CPU_TIMED_CALLS calls after one warm-up (none for a single call)."""
    if torch.device(device).type != "cuda":
        if CPU_TIMED_CALLS > 1:
            fn()
        times = []
        for _ in range(CPU_TIMED_CALLS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graph_ms(calls: list) -> float:
    """Milliseconds per call of `calls` captured in one CUDA graph and replayed, as decode runs them (no Python
    launch cost); give each call its own weights, so that one call's working set is not in L2 for the next."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compilation, the allocator
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_ms(graph.replay) / len(calls)


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def device_name(device: str | torch.device) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else str(device)


def measure_ceilings(device: str = "cuda") -> dict:
    """{'copy_TBps', 'bf16_matmul_TFLOPs'} on this GPU, now (2 GiB copies, 8192^3 matmuls; elsewhere 16 MiB
    and 256^3)."""
    cuda = torch.device(device).type == "cuda"
    n, m = (2 * 1024**3, 8192) if cuda else (16 * 1024**2, 256)
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device)
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, device)
    src = dst = a = b = None  # noqa: F841 - give the memory back before the measured work
    if cuda:
        torch.cuda.empty_cache()
    return {
        "copy_TBps": 2 * n / (copy_ms * 1e-3) / 1e12,
        "bf16_matmul_TFLOPs": 2 * m**3 / (mm_ms * 1e-3) / 1e12,
    }


def dependent_chain(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, links: int) -> torch.Tensor:
    """`links` x (RMSNorm, then the sigmoid gate): 2 * links decode kernels in a row that do almost nothing,
    each reading the one before (`measure_launch_floor`; scripts/decode_kernels_check.py's pdl section)."""
    from kestrel.ops.activation.triton_act import sigmoid_gate_triton
    from kestrel.ops.norm.triton_norm import rms_norm_triton

    for _ in range(links):
        x = sigmoid_gate_triton(rms_norm_triton(x, weight, 1e-6), gate)
    return x


def measure_launch_floor(device: str = "cuda", links: int = 100, width: int = 2048) -> float | None:
    """Microseconds a kernel costs in `dependent_chain` (2 * links kernels on one row `width` wide) replayed from
    one CUDA graph, launched as the engine launches them (with programmatic dependent launch where
    kestrel.ops.pdl has it on): the least a launch adds to a decode step, however few bytes it moves. None off
    CUDA (no graphs there). On the H200: 0.93-0.98 us with PDL, 1.59-1.60 with KESTREL_PDL=off (sessions 23 and
    46)."""
    if torch.device(device).type != "cuda":
        return None
    g = torch.Generator(device=device).manual_seed(0)
    w = (torch.rand(width, generator=g, device=device) + 0.5).to(torch.bfloat16)
    x, gate = torch.randn(2, 1, width, generator=g, device=device).to(torch.bfloat16)
    return 1000 * graph_ms([lambda: dependent_chain(x, w, gate, links)]) / (2 * links)


def launch_floor_share(kernels: float, floor_us: float, total_bytes: float, copy_TBps: float) -> dict:
    """A step's launches against its bytes: `kernels` launches at `floor_us` each (`measure_launch_floor`) and
    `total_bytes` at the copy rate, in ms a step, and the MBU the step would reach if the two added up (an
    estimate, not a bound: a kernel's weight loads issued before its PDL wait overlap the boundary)."""
    launches_ms = kernels * floor_us / 1e3
    bytes_ms = total_bytes / (copy_TBps * 1e12) * 1e3
    return {
        "kernels": kernels,
        "floor_us": floor_us,
        "launches_ms": launches_ms,
        "bytes_ms_at_copy": bytes_ms,
        "mbu_if_added": bytes_ms / (bytes_ms + launches_ms),
    }


def require_cuda(what: str) -> None:
    from kestrel.utils.errors import KestrelError

    if not torch.cuda.is_available():
        raise KestrelError(f"{what} measures GPU kernels: it needs a CUDA device")
