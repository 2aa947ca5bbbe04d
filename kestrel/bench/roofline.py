"""The ceilings every GPU figure is reported against, measured in the same run: device-to-device copy
bandwidth (bytes read + written) and a large bf16 matmul rate; and median timers for GPU work (queued calls, or
calls replayed from one CUDA graph as decode runs them).

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


def require_cuda(what: str) -> None:
    from kestrel.utils.errors import KestrelError

    if not torch.cuda.is_available():
        raise KestrelError(f"{what} measures GPU kernels: it needs a CUDA device")
