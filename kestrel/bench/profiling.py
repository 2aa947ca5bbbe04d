"""Reading torch.profiler results: which tensor shapes the GPU time went to."""

from __future__ import annotations


def ops_by_shape(prof, top: int, time_key: str = "ms") -> list[dict]:
    """The CPU-side events (ATen ops, and record_function ranges holding Triton launches) whose own kernels took
    the most GPU time, grouped by input shapes: which tensor a kernel ran on. `prof` ran with record_shapes=True;
    each row's GPU milliseconds are under `time_key`."""
    from torch.autograd import DeviceType

    ops = (e for e in prof.key_averages(group_by_input_shape=True) if e.device_type != DeviceType.CUDA)
    return [
        {
            "name": e.key,
            "shapes": str(e.input_shapes)[:200],
            time_key: e.self_device_time_total / 1e3,
            "calls": e.count,
        }
        for e in sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    ]
