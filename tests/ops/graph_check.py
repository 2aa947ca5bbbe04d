"""CUDA-graph capture check for the host-sync-free decode ops.

A host sync (.item(), .tolist(), bool(tensor), nonzero, data-dependent shapes) fails during capture, and a
value read on the host at capture time would be frozen into the graph; replaying on fresh inputs copied into
the captured tensors, against eager on the same inputs, catches both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def assert_replay_matches_eager(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Sequence[torch.Tensor],
    fresh_inputs: Sequence[torch.Tensor],
) -> None:
    """Capture fn(*inputs), copy fresh_inputs into inputs, replay, and compare with eager fn(*fresh_inputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: lazy init, allocator, kernel choice
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*inputs)
    for static, fresh in zip(inputs, fresh_inputs):
        static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    expected = fn(*fresh_inputs)
    captured = captured if isinstance(captured, tuple) else (captured,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(captured, expected):
        # Not bitwise: fp32 atomics (index_add_) may add in another order.
        torch.testing.assert_close(got, want)
