"""One row of `kestrel bench kernels`: a kernel's time against the bytes it must move and its FLOPs, as rates
and as shares of the ceilings measured in the run; and the helpers the per-op benchmarks share (a sweep of
launch configurations, the GPU time of each kernel one call launches)."""

from __future__ import annotations

import torch

from kestrel.bench.roofline import time_ms


def kernel_row(name: str, ms: float, nbytes: float, flops: float, ceilings: dict, **extra) -> dict:
    """The row, printed as it is made: achieved TB/s and TFLOP/s against the copy and matmul ceilings, and
    the peer's and the CUDA graph's times where `extra` has them."""
    bw = nbytes / (ms * 1e-3) / 1e12
    rate = flops / (ms * 1e-3) / 1e12
    out = {
        "kernel": name,
        "ms": ms,
        "bytes": nbytes,
        "flops": flops,
        "TBps": bw,
        "bandwidth_of_copy": bw / ceilings["copy_TBps"],
        "TFLOPs": rate,
        "flops_of_matmul": rate / ceilings["bf16_matmul_TFLOPs"],
        **extra,
    }
    peer, graph = extra.get("peer_ms"), extra.get("graph_ms")
    print(
        f"{name:44s} {ms * 1000:9.1f} us  {bw:6.2f} TB/s ({out['bandwidth_of_copy']:5.1%} of copy)"
        + (f"  peer {peer * 1000:9.1f} us  x{peer / ms:5.2f}" if peer else "")
        + (f"  graph {graph * 1000:7.1f} us" if graph else ""),
        flush=True,
    )
    return out


def time_configs(fns: dict, device: str, err_name: str, err) -> dict:
    """Each of `fns` (name -> a call of one kernel configuration) timed, with err(fn) under `err_name`: how far
    its answer is from the reference. A configuration that fails (a tile that does not fit in shared memory
    fails to compile) is recorded with its error, and the others still run."""
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = {"ms": time_ms(fn, device), err_name: err(fn)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": repr(e)[:300]}
    return out


def stage_times(fn, device: str) -> dict | None:
    """GPU time of each kernel one call of `fn` launches (torch.profiler), to see which stage dominates."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:60]: e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0}
