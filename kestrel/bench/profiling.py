"""Reading torch.profiler results: which tensor shapes the GPU time went to, and how much of a span the GPU was
busy."""

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


def busy_time(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span) of (start, end) intervals: the length of their union, and of first start to last end. On a
    profile's kernels, busy / span is the share of the time some kernel ran (the rest the GPU waited)."""
    if not spans:
        return 0.0, 0.0
    spans = sorted(spans)
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:  # a gap: close the running interval
            busy, start, end = busy + end - start, s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy, max(e for _, e in spans) - spans[0][0]
