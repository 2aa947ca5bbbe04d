"""Programmatic dependent launch (kestrel.ops.pdl): off wherever it cannot run, on for Hopper, and a chain of
dependent PDL kernels replayed from a CUDA graph gives the bits of the same chain launched without it."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kestrel.ops import pdl  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_off_on_the_cpu():
    assert pdl.pdl_args(torch.zeros(1)) == {}


@cuda
def test_switch(monkeypatch):
    x = torch.zeros(1, device="cuda")
    monkeypatch.setenv("KESTREL_PDL", "off")
    assert pdl.pdl_args(x) == {}
    monkeypatch.setenv("KESTREL_PDL", "auto")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_args(x) == ({"PDL": True, "launch_pdl": True} if hopper else {})
    monkeypatch.setenv("KESTREL_PDL", "sometimes")
    with pytest.raises(ValueError, match="KESTREL_PDL"):
        pdl.pdl_args(x)


def _chain(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, links: int) -> torch.Tensor:
    """links x (RMSNorm, then sigmoid gate): each kernel reads the one before it."""
    from kestrel.ops.activation.triton_act import sigmoid_gate_triton
    from kestrel.ops.norm.triton_norm import rms_norm_triton

    for _ in range(links):
        x = sigmoid_gate_triton(rms_norm_triton(x, w, 1e-6), gate)
    return x


@cuda
@pytest.mark.parametrize("rows", [1, 257])
def test_graph_chain_matches_plain_launches(monkeypatch, rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2048, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    gate = torch.randn(rows, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("KESTREL_PDL", "off")
    want = _chain(x, w, gate, 40)
    monkeypatch.setenv("KESTREL_PDL", "auto")
    eager = _chain(x, w, gate, 40)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _chain(static, w, gate, 40)  # compiles the PDL variants outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(static, w, gate, 40)
    static.copy_(torch.randn_like(x))
    graph.replay()
    static.copy_(x)  # the second replay must see this write, made after the first replay's 80 kernels
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, want)
    assert torch.equal(got, want)
