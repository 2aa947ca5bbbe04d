"""The fused Triton router equals the reference `route` (one group): same experts in the same order, same
weights; ties go to the lower expert id. Runs in Triton's interpreter on CPU (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.moe.naive import route

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "E,A,renorm,bias", [(8, 2, True, True), (64, 6, True, True), (13, 3, False, False), (896, 16, True, True)]
)
def test_router_matches_reference(E, A, renorm, bias):
    from kestrel.ops.moe.triton_router import route_triton

    g = torch.Generator().manual_seed(E + A)
    logits = torch.randn(7, E, generator=g).to(DEVICE)
    b = (0.1 * torch.randn(E, generator=g)).to(DEVICE) if bias else None
    ref_w, ref_i = route(logits, b, A, renorm, 2.5)
    got_w, got_i = route_triton(logits, b, A, renorm, 2.5)
    assert torch.equal(got_i, ref_i)
    assert torch.allclose(got_w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("E,S", [(64, 3), (13, 3), (896, 3), (8, 1)])
def test_router_adds_partial_logits(E, S):
    """route_triton of [T, S, E] partial logits (the router GEMM's three bf16 parts, as a strided view of its
    [T, S * E] output) equals `route` of their sum."""
    from kestrel.ops.moe.triton_router import route_triton

    g = torch.Generator().manual_seed(E + S)
    parts = torch.randn(7, S * E + 5, generator=g)[:, :-5].view(7, S, E)  # rows strided past S * E
    b = 0.1 * torch.randn(E, generator=g)
    ref_w, ref_i = route(parts.sum(1), b, min(6, E), True, 2.5)
    got_w, got_i = route_triton(parts.to(DEVICE), b.to(DEVICE), min(6, E), True, 2.5)
    assert torch.equal(got_i.cpu(), ref_i)
    assert torch.allclose(got_w.cpu(), ref_w, atol=1e-6, rtol=1e-5)


def test_router_ties_pick_lower_ids():
    from kestrel.ops.moe.triton_router import route_triton

    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.5]], device=DEVICE)
    w, i = route_triton(logits, None, 3, True, 1.0)
    assert i.tolist() == [[1, 2, 4]]
    assert torch.equal(i, route(logits, None, 3, True, 1.0)[1])


@pytest.mark.parametrize(
    "E,A,renorm,bias,D",
    [
        (64, 6, True, True, 300),
        (13, 3, False, False, 128),
        (8, 2, True, True, 40),
        (896, 16, True, True, 300),
    ],
)
@pytest.mark.parametrize("T,programs", [(5, 256), (5, 4)])
def test_router_from_hidden_states_matches_reference(E, A, renorm, bias, D, T, programs):
    """route_hidden_triton computes the logits too: the reference's fp32 product, then `route` (bf16 hidden
    states, rows strided as a slice of a wider tensor, D not a multiple of the slice; at 896 experts the slices
    are narrow and their sum walks them in several steps), in narrow slices (programs=256: many a token) or wide
    ones."""
    from kestrel.ops.moe.triton_router import route_hidden_triton

    g = torch.Generator().manual_seed(E * D)
    hidden = torch.randn(T, D + 3, generator=g).to(DEVICE, torch.bfloat16)[:, 1 : D + 1]
    weight = torch.randn(E, D, generator=g).to(DEVICE) * D**-0.5
    b = (0.1 * torch.randn(E, generator=g)).to(DEVICE) if bias else None
    ref_w, ref_i = route(hidden.float() @ weight.t(), b, A, renorm, 2.5)
    got_w, got_i = route_hidden_triton(hidden, weight, b, A, renorm, 2.5, programs=programs)
    assert torch.equal(got_i, ref_i)
    assert torch.allclose(got_w, ref_w, atol=1e-5, rtol=1e-4)


def test_router_from_hidden_states_of_no_tokens():
    from kestrel.ops.moe.triton_router import route_hidden_triton

    w, i = route_hidden_triton(
        torch.zeros(0, 64, device=DEVICE), torch.ones(8, 64, device=DEVICE), None, 2, True, 1.0
    )
    assert w.shape == (0, 2) and i.shape == (0, 2)


@pytest.mark.parametrize("T,D,E,programs", [(70, 200, 13, 128), (17, 256, 64, 4), (3, 96, 8, 128)])
def test_router_dot_parts_sum_to_the_logits(T, D, E, programs):
    """router_logit_parts_triton: bf16 x (rows strided, T and D past whole tiles, E not a power of two) times
    the weight's exact bf16 split, as [T, S, E] partial logits. Their sum is the fp32 product within fp32's
    rounding bound, with the same experts as the reference, and `route_triton` of them routes as `route`."""
    from kestrel.ops.moe.router_gemm import split_bf16x3
    from kestrel.ops.moe.triton_router import route_triton, router_logit_parts_triton

    g = torch.Generator().manual_seed(T + D + E)
    x = torch.randn(T, D + 5, generator=g).to(torch.bfloat16)[:, 2 : D + 2]
    w = torch.randn(E, D, generator=g) * D**-0.5
    got = router_logit_parts_triton(x.to(DEVICE), split_bf16x3(w).to(DEVICE), programs=programs).cpu()
    assert got.dtype == torch.float32 and got.shape[0] == T and got.shape[2] == E
    exact = x.double() @ w.double().t()  # [T, E]
    bound = D * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert ((got.double().sum(1) - exact).abs() <= bound).all()
    b = 0.01 * torch.randn(E, generator=g)
    ref_w, ref_i = route(x.float() @ w.t(), b, min(6, E), True, 2.5)
    got_w, got_i = route_triton(got.to(DEVICE), b.to(DEVICE), min(6, E), True, 2.5)
    assert torch.equal(got_i.cpu(), ref_i)
    assert torch.allclose(got_w.cpu(), ref_w, atol=1e-5, rtol=1e-4)
