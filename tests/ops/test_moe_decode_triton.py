"""The MoE layer in one launch (kestrel.ops.moe.triton_decode) against the plain-torch router and experts.

Without CUDA the kernel runs in Triton's interpreter as its three phases, three launches (a grid barrier cannot
open there); with CUDA the same cases run as one launch, and the `gpu` tests add that the one launch equals the
three bit for bit, leaves its barrier counters at zero, replays in a CUDA graph, and that the MoE layer at
batch 1 takes it (KESTREL_MOE_FUSED_DECODE) with the routing the reference picks.

Legend: T tokens, D hidden width, E experts, A experts per token, I expert width.
"""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.moe import glu_mlp, moe_experts, route
from tests.ops.graph_check import assert_replay_matches_eager

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# partial tiles, two D slices of gate/up, several K steps, at D=40, I=24
SMALL = dict(bd=16, ks=2, bn_g=16, bk_g=16, bn_d=16, bk_d=16)
# the whole of D in each gate/up item, which then stores h itself; down tiles of 4 output rows
WHOLE_D = dict(SMALL, ks=1, bn_g=8, bn_d=4)
DEFERRED = dict(WHOLE_D, defer=1)  # gate/up's K steps reduced once
ROUTER_EARLY = dict(SMALL, router_early=1)  # each program's first router item's weights before the PDL wait
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _layer(T, D, I, E, dtype, seed):
    """x, router weight [E, D] and bias (fp32), routed experts (w13, w2), a shared expert (ws13, ws2), a residual."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, fan_in=1):
        return torch.randn(*shape, generator=g) / fan_in**0.5

    x, residual = r(T, D), r(T, D)
    router, bias = r(E, D, fan_in=D), 0.1 * r(E)
    w13, w2 = r(E, 2 * I, D, fan_in=D), r(E, D, I, fan_in=I)
    s13, s2 = r(2 * I, D, fan_in=D), r(D, I, fan_in=I)
    to = dict(device=DEVICE, dtype=dtype)
    return dict(
        x=x.to(**to),
        router=router.to(DEVICE),
        bias=bias.to(DEVICE),
        w13=w13.to(**to),
        w2=w2.to(**to),
        shared=(s13.to(**to), s2.to(**to)),
        residual=residual.to(**to),
    )


def _reference(p, A, act, shared, accumulate, scaling=2.5):
    """The layer as the plain-torch ops compute it: fp32 router, routed experts, the shared MLP, the residual;
    each sum in x's dtype, as the layer adds them."""
    weights, ids = route(p["x"].float() @ p["router"].t(), p["bias"], A, True, scaling)
    out = moe_experts(p["x"], p["w13"], p["w2"], weights, ids, act)
    if shared:
        out = out + glu_mlp(p["x"], *p["shared"], act)
    if accumulate:
        out = p["residual"] + out
    return out, weights, ids


def _run(p, A, act, shared, accumulate, **kw):
    from kestrel.ops.moe.triton_decode import moe_decode_triton

    out = p["residual"].clone() if accumulate else torch.full_like(p["x"], float("nan"))
    return moe_decode_triton(
        p["x"], p["router"], p["bias"], A, True, 2.5, p["w13"], p["w2"], act,
        shared=p["shared"] if shared else None, out=out, accumulate=accumulate, **kw,
    )  # fmt: skip


def _assert_close(got, want):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # rounded where the reference rounds: a flipped last bit of gate/up, h or an expert's output apart
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "tiles", [SMALL, WHOLE_D, DEFERRED, ROUTER_EARLY], ids=["ks2", "ks1", "ks1-deferred", "router-early"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "T,act,shared,accumulate",
    [(1, "situ", True, True), (1, "silu", False, False), (2, "situ", False, True), (2, "silu", True, False)],
)
def test_matches_router_and_experts(T, act, shared, accumulate, dtype, tiles):
    p = _layer(T, D=40, I=24, E=5, dtype=dtype, seed=T + 3 * shared)
    out, weights, ids = _run(p, 3, act, shared, accumulate, tiles=tiles)
    want, want_w, want_ids = _reference(p, 3, act, shared, accumulate)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    _assert_close(out, want)


@pytest.mark.parametrize("programs", [1, 2, 64])
def test_any_grid_and_default_tiles(programs):
    """One program walking every item, a few, more than there are items (clipped); and the GPU's tiles, larger
    than every dimension here."""
    p = _layer(1, D=40, I=24, E=6, dtype=torch.float32, seed=9)
    want = _reference(p, 4, "situ", True, False)[0]
    for tiles in (SMALL, WHOLE_D, None, ROUTER_EARLY):
        out, _, _ = _run(p, 4, "situ", True, False, tiles=tiles, programs=programs)
        _assert_close(out, want)
    # the router's first items' weights loaded early: the same bits (programs 1 and 2 walk more items after it)
    late = _run(p, 4, "situ", True, False, tiles=SMALL, programs=programs)
    early = _run(p, 4, "situ", True, False, tiles=ROUTER_EARLY, programs=programs)
    assert all(torch.equal(a, b) for a, b in zip(late, early))


def test_phases_apart_through_scratch():
    """Each phase launched alone, in order, its inputs handed on in one scratch dict: the same bits as the three
    phases in one call; a scratch of other shapes, or phases apart without phased, are refused."""
    p = _layer(2, D=40, I=24, E=5, dtype=torch.float32, seed=11)
    whole = _run(p, 3, "situ", True, True, tiles=SMALL, phased=True)
    scratch = {}
    for phase in (1, 2, 3):
        apart = _run(p, 3, "situ", True, True, tiles=SMALL, phased=True, phases=(phase,), scratch=scratch)
    for a, b in zip(whole, apart):
        assert torch.equal(a, b)
    assert set(scratch) == {"weights", "ids", "partial", "gu"}
    with pytest.raises(AssertionError, match="scratch of other shapes"):
        _run(p, 3, "situ", True, True, tiles={**SMALL, "ks": 1}, phased=True, phases=(3,), scratch=scratch)
    with pytest.raises(AssertionError, match="phased"):
        _run(p, 3, "situ", True, True, tiles=SMALL, phased=False, phases=(1,))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's one-program launch")
@pytest.mark.parametrize("router_early", [0, 1])
@pytest.mark.parametrize("early", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_program_launch_equals_the_phases_on_the_cpu(early, dtype, router_early):
    """The one-launch path (both grid barriers, PHASE 0) in the interpreter, whose only grid is one program:
    with a down tile over all of D and I one K step, the down weights loaded before the gate/up items (early
    1), after them (2) or after barrier 1 (0); each the phased launches' bits. Larger grids are refused."""
    from kestrel.ops.moe.triton_decode import _sync_buffer

    p = _layer(1, D=40, I=24, E=6, dtype=dtype, seed=21 + early)
    tiles = dict(WHOLE_D, bn_d=64, bk_d=32, early=early, router_early=router_early)
    launch = {}
    one = _run(p, 4, "situ", True, True, tiles=tiles, phased=False, programs=1, launch=launch)
    assert launch == {"programs": 1, "early": early}
    three = _run(p, 4, "situ", True, True, tiles=tiles, phased=True, programs=1)
    for a, b in zip(one, three):
        assert torch.equal(a, b)
    assert _sync_buffer(p["x"].device).tolist() == [0, 0, 0, 0]
    _assert_close(one[0], _reference(p, 4, "situ", True, True)[0])
    with pytest.raises(AssertionError, match="one program"):
        _run(p, 4, "situ", True, True, tiles=tiles, phased=False, programs=2)
    with pytest.raises(AssertionError, match="early 3"):
        _run(p, 4, "situ", True, True, tiles={**tiles, "early": 3}, phased=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's one-program launch")
def test_one_program_launch_of_two_tokens_on_the_cpu():
    """Two tokens in one launch on the CPU (the default grid there: one program; no early loads): the phased
    launches' bits."""
    p = _layer(2, D=40, I=24, E=6, dtype=torch.float32, seed=31)
    launch = {}
    one = _run(p, 4, "situ", True, True, tiles=WHOLE_D, phased=False, launch=launch)
    assert launch == {"programs": 1, "early": 0}
    three = _run(p, 4, "situ", True, True, tiles=WHOLE_D, phased=True)
    for a, b in zip(one, three):
        assert torch.equal(a, b)


def test_no_tokens_and_bad_input():
    p = _layer(1, D=40, I=24, E=5, dtype=torch.float32, seed=1)
    empty = {**p, "x": p["x"][:0], "residual": p["residual"][:0]}
    out, weights, ids = _run(empty, 3, "silu", True, True)
    assert out.shape == (0, 40) and weights.shape == ids.shape == (0, 3)
    with pytest.raises(ValueError, match="unknown activation"):
        _run(p, 3, "gelu", True, False)
    with pytest.raises(AssertionError, match="one dtype"):
        _run({**p, "w2": p["w2"].double()}, 3, "silu", False, False)


def test_trace_summary_reads_spans_and_arrivals():
    """Two programs at 2 GHz: their clocks' spans in us (median, largest) and when each point was first and
    last reached on the ns timer; a trace on the CPU (the interpreter runs no inline PTX) is refused."""
    from kestrel.ops.moe.triton_decode import TRACE_SPANS, trace_summary

    steps = torch.tensor([[1.0, 2, 3, 4, 5, 6, 7], [3.0, 2, 1, 4, 5, 6, 9]])  # us a span, per program
    at = torch.cat([torch.zeros(2, 1), steps.cumsum(1)], 1)  # us at each point from the program's start
    at[1] += 0.5  # the second program starts half a microsecond later
    trace = torch.cat([(at * 2000).long() + 10**6, (at * 1000).long() + 10**9], 1)  # cycles, ns
    got = trace_summary(trace, 2)
    assert abs(got["clock_ghz"] - 2.0) < 1e-9
    assert got["spans_us"]["router"] == {"median": 1.0, "max": 3.0}  # torch's median: the lower of two
    assert got["spans_us"][TRACE_SPANS[-1]]["max"] == 9.0
    assert got["reached_us"]["start"] == {"first": 0.0, "last": 0.5}
    assert got["reached_us"]["end"] == {"first": 28.0, "last": 30.5}
    p = _layer(1, D=40, I=24, E=5, dtype=torch.float32, seed=2)
    if DEVICE == "cpu":
        with pytest.raises(AssertionError, match="one launch on CUDA"):
            _run(p, 3, "situ", True, True, trace=torch.zeros(8, 16, dtype=torch.int64))


# ---------------------------------------------------------------- CUDA: one launch, graphs, the layer

MINI = dict(D=2048, I=256, E=64)  # presets._MINI: hidden 2048, 64 experts of width 256, top-6, one shared


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "T,tiles,taken",
    [
        (1, {}, 2),
        (1, dict(early=0), 0),
        (1, dict(early=1, bn_d=8), 1),
        (1, dict(early=1), None),
        (3, {}, 0),
        (1, dict(router_early=1), 2),
        (3, dict(router_early=1), 0),
    ],
    ids=["1-early2", "1-early0", "1-early1", "1-early1-fallback", "3", "1-router-early", "3-router-early"],
)
def test_one_launch_equals_three_at_mini_sizes(T, tiles, taken):
    """The grid barriers: one launch gives the three phased launches' bits, leaves the counters at zero with
    no barrier given up, and is deterministic; both match the reference within bf16's rounding. At one token
    the down weights' loads go out after the gate/up items (early 2, the default), before them (1: with down
    tiles of 8 rows, 256 items; at 4 rows the registers held may leave room for too few programs, and none go
    early) or after barrier 1 (0); three tokens take none early."""
    from kestrel.ops.moe.triton_decode import _sync_buffer

    p = _layer(T, dtype=torch.bfloat16, seed=40 + T, **MINI)
    from kestrel.ops.moe.triton_decode import TILES

    launch = {}
    one = _run(p, 6, "situ", True, True, tiles=tiles, launch=launch)
    down_items = -(-MINI["D"] // tiles.get("bn_d", TILES["bn_d"]))
    if taken is not None and launch["programs"] >= down_items:
        assert launch["early"] == taken, launch
    else:  # a GPU holding fewer programs than there are down items (or the fallback): none early
        assert launch["early"] in (0, tiles.get("early", TILES["early"])), launch
    three = _run(p, 6, "situ", True, True, tiles=tiles, phased=True)
    torch.cuda.synchronize()
    assert _sync_buffer(p["x"].device).tolist() == [0, 0, 0, 0]
    for a, b in zip(one, three):
        assert torch.equal(a, b)
    again = _run(p, 6, "situ", True, True, tiles=tiles)
    assert all(torch.equal(a, b) for a, b in zip(one, again)), "not deterministic"
    want, _, want_ids = _reference(p, 6, "situ", True, True)
    assert torch.equal(one[2], want_ids)
    delta = one[0].float() - p["residual"].float()  # the layer's own output, without the residual
    rel = ((delta - (want.float() - p["residual"].float())).norm() / delta.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.gpu
@requires_cuda
def test_grid_never_larger_than_the_gpu_holds():
    """Asked for more programs than the SMs hold at once (1-row tiles: 2048 down items; 32 programs an SM of 4
    warps), the launch takes only what fits: its barriers open, and it gives the phased launches' bits."""
    from kestrel.ops.moe.triton_decode import _sync_buffer

    p = _layer(1, dtype=torch.bfloat16, seed=60, **MINI)
    tiles = dict(ks=1, bn_g=1, bk_g=2048, bn_d=1, bk_d=256, per_sm=32)
    launch = {}
    one = _run(p, 6, "situ", True, True, tiles=tiles, launch=launch)
    three = _run(p, 6, "situ", True, True, tiles=tiles, phased=True)
    torch.cuda.synchronize()
    assert _sync_buffer(p["x"].device).tolist() == [0, 0, 0, 0]
    assert launch["programs"] < 2048, launch
    for a, b in zip(one, three):
        assert torch.equal(a, b)


@pytest.mark.gpu
@requires_cuda
def test_traced_launch_gives_the_same_bits_and_ordered_stamps():
    """A traced launch (each program's clock and timer at every point) computes what the untraced one does;
    every program's stamps rise through the points, and no program passes a barrier before the last one
    reached it."""
    from kestrel.ops.moe.triton_decode import trace_summary

    p = _layer(1, dtype=torch.bfloat16, seed=70, **MINI)
    launch = {}
    plain = _run(p, 6, "situ", True, True, launch=launch)
    trace = torch.zeros(4096, 16, dtype=torch.int64, device="cuda")
    traced = _run(p, 6, "situ", True, True, trace=trace)
    for a, b in zip(plain, traced):
        assert torch.equal(a, b)
    n = launch["programs"]
    stamps = trace[:n].cpu()
    assert (stamps[:, 1:8] >= stamps[:, 0:7]).all() and (stamps[:, 9:16] >= stamps[:, 8:15]).all()
    assert stamps[:, 10].min() >= stamps[:, 9].max()  # barrier 0 passed after the last arrival
    assert stamps[:, 13].min() >= stamps[:, 12].max()  # barrier 1 alike
    got = trace_summary(trace, n)
    assert 0.5 < got["clock_ghz"] < 3.0, got


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_replay():
    """Captured once, replayed on new hidden states and a new residual: the routing and the output follow."""
    p = _layer(1, dtype=torch.bfloat16, seed=50, **MINI)

    def layer(x, residual):
        return _run({**p, "x": x, "residual": residual}, 6, "situ", True, True)

    assert_replay_matches_eager(layer, (p["x"], p["residual"]), (torch.randn_like(p["x"]), p["residual"] * 2))


@pytest.mark.gpu
@requires_cuda
def test_moe_layer_takes_it_at_batch_1(monkeypatch):
    """KESTREL_MOE_FUSED_DECODE: a MoE layer with a shared MLP of the experts' width (tiny without its latent
    MoE and its expert groups) at one token runs the one launch; its output and captured routing match the
    layer's six launches (KESTREL_MOE_FUSED_DECODE=0), the residual added in place either way; two tokens never
    take it."""
    from kestrel.layers.context import ForwardContext, forward_context
    from kestrel.layers.moe import MoE
    from kestrel.ops.moe import triton_decode
    from kestrel.presets import preset_config
    from tests.ops.test_moe_triton import _randomize

    config = preset_config("tiny").replace(
        routed_expert_hidden_size=None, latent_moe_use_norm=False, num_expert_group=1, topk_group=1
    )
    moe = MoE(config, layer_id=1, dtype=torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(6)
    calls = []
    real = triton_decode.moe_decode_triton
    monkeypatch.setattr(triton_decode, "moe_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        _randomize(moe, g)
        x = torch.randn(1, config.hidden_size, generator=g, device="cuda").bfloat16()
        residual = torch.randn_like(x)
        outs, routes = {}, {}
        for on in ("0", "1"):
            monkeypatch.setenv("KESTREL_MOE_FUSED_DECODE", on)
            ctx = ForwardContext(
                positions=torch.zeros(1, dtype=torch.int64, device="cuda"),
                cu_seqlens=torch.tensor([0, 1], device="cuda"),
                new_lens=[1],
                prefix_lens=[0],
                routing_capture={},
            )
            with forward_context(ctx):
                into = residual.clone()
                assert moe(x, add_to=into) is into
            outs[on], routes[on] = into, ctx.routing_capture[1]
        assert calls == [1]
        assert torch.equal(routes["0"], routes["1"])
        rel = ((outs["1"] - outs["0"]).float().norm() / (outs["0"] - residual).float().norm()).item()
        assert rel < 1e-2, rel
        moe(torch.randn(2, config.hidden_size, device="cuda").bfloat16())
        assert calls == [1]


def test_barrier_gave_up_reads_and_clears_the_flag():
    """barrier_gave_up: sync[3] raised by a launch is reported once, and the counters are zeroed with it."""
    from kestrel.ops.moe.triton_decode import _sync_buffer, barrier_gave_up

    sync = _sync_buffer(torch.device("cpu"))
    assert not barrier_gave_up("cpu")
    sync[1], sync[3] = 5, 1  # a barrier's count left raised by late programs, and the flag
    assert not barrier_gave_up("meta")  # no launch on that device
    assert barrier_gave_up("cpu")
    assert sync.tolist() == [0, 0, 0, 0]
    assert not barrier_gave_up("cpu")
