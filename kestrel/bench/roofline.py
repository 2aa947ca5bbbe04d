"""The ceilings every GPU figure is reported against, measured in the same run: device-to-device copy
bandwidth (bytes read + written) and a large bf16 matmul rate; and a median timer for GPU work."""

from __future__ import annotations

from collections.abc import Callable

import torch


def gpu_time_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of `fn` on the GPU (triton's do_bench: iterations queued back to back with CUDA
    events, the L2 cache flushed before each, so a small working set is not read from cache)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def measure_ceilings() -> dict:
    """{'copy_TBps', 'bf16_matmul_TFLOPs'} on this GPU, now."""
    n = 2 * 1024**3
    src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_ms = gpu_time_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = gpu_time_ms(lambda: a @ b)
    src = dst = a = b = None  # noqa: F841 - give the memory back before the measured work
    torch.cuda.empty_cache()
    return {
        "copy_TBps": 2 * n / (copy_ms * 1e-3) / 1e12,
        "bf16_matmul_TFLOPs": 2 * 8192**3 / (mm_ms * 1e-3) / 1e12,
    }


def require_cuda(what: str) -> None:
    from kestrel.utils.errors import KestrelError

    if not torch.cuda.is_available():
        raise KestrelError(f"{what} measures GPU kernels: it needs a CUDA device")
