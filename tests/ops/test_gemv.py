"""The Triton GEMV (kestrel.ops.linear.triton_gemv) against F.linear, and where `linear` picks it. Without CUDA
the kernel runs under TRITON_INTERPRET=1 (fp32 operands); with CUDA in bf16, PDL and the weight prefetch on
Hopper. Outputs are fresh tensors: a column the kernel never writes fails the comparison."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.kernel_modules import load_kernels  # sets TRITON_INTERPRET without CUDA

triton = pytest.importorskip("triton")

from kestrel.ops import linear as linear_ops  # noqa: E402

load_kernels("kestrel.ops.linear.triton_gemv")
from kestrel.ops.linear.triton_gemv import (  # noqa: E402
    ROWS_AUTO_M,
    ROWS_MAX_M,
    SEGMENTS,
    gemv_many_triton,
    gemv_triton,
    rows_applies,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the two kernels: "rows" (a few rows, each program's weights in one load) and "dot" (the K loop)
KERNELS = ("rows", "dot")


def _skip_unless_taken(kernel: str, M: int) -> None:
    if kernel == "rows" and M > ROWS_MAX_M:
        pytest.skip(f"the rows kernel takes up to {ROWS_MAX_M} rows")


def _close(got, want):
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item()
    )


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "M,N,K", [(1, 17, 100), (3, 40, 300), (16, 1, 8), (5, 33, 520), (4, 70, 1000), (2, 9, 3)]
)
def test_gemv_matches_linear(M, N, K, kernel):
    _skip_unless_taken(kernel, M)
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, DTYPE)
    w = torch.randn(N, K, generator=g).to(DEVICE, DTYPE)
    _close(gemv_triton(x, w, kernel=kernel), F.linear(x, w))


@pytest.mark.parametrize("programs", [None, 1, 3])
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("block_n", [1, 4, 64])
def test_gemv_rows_tiles(block_n, early, programs):
    """The rows kernel at tiles that do not divide N, one row a program, the load after the wait, and grids
    smaller than the slices (each program walking several, the next one's loads out first)."""
    g = torch.Generator().manual_seed(block_n)
    x = torch.randn(3, 72, generator=g).to(DEVICE, DTYPE)
    w = torch.randn(37, 72, generator=g).to(DEVICE, DTYPE)
    got = gemv_triton(
        x, w, kernel="rows", rows_block_n=block_n, rows_warps=2, early=early, rows_programs=programs
    )
    _close(got, F.linear(x, w))
    if programs:  # the same sums as a program a slice
        assert torch.equal(
            got, gemv_triton(x, w, kernel="rows", rows_block_n=block_n, rows_warps=2, early=early)
        )


def test_gemv_rows_walks_slices_across_weights():
    """A grid smaller than the slices over six weights (slices of 4 rows, widths that split them): each
    program's walk crosses from one weight to the next."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 100, generator=g).to(DEVICE, DTYPE)
    ws = [torch.randn(n, 100, generator=g).to(DEVICE, DTYPE) for n in (17, 1, 40, 33, 5, 64)]
    for got, w in zip(gemv_many_triton(x, ws, kernel="rows", rows_block_n=4, rows_programs=5), ws):
        _close(got, F.linear(x, w))


def test_gemv_rows_only_where_asked_and_taken(monkeypatch):
    """auto (the default) puts up to ROWS_AUTO_M rows on the rows kernel, rows up to ROWS_MAX_M, dot none; widths
    above ROWS_MAX_K never."""
    monkeypatch.delenv("KESTREL_GEMV", raising=False)
    assert ROWS_AUTO_M < ROWS_MAX_M
    assert rows_applies(1, 2048) and rows_applies(ROWS_AUTO_M, 1000)
    assert not rows_applies(ROWS_AUTO_M + 1, 2048) and not rows_applies(1, 8192) and not rows_applies(0, 64)
    monkeypatch.setenv("KESTREL_GEMV", "rows")
    assert rows_applies(1, 2048) and rows_applies(ROWS_MAX_M, 1000)
    assert not rows_applies(ROWS_MAX_M + 1, 2048) and not rows_applies(1, 8192)
    for mode in ("dot", "off"):
        monkeypatch.setenv("KESTREL_GEMV", mode)
        assert not rows_applies(1, 2048)
    x = torch.zeros(ROWS_MAX_M + 1, 32, device=DEVICE, dtype=DTYPE)
    with pytest.raises(AssertionError, match="the rows kernel takes up to"):
        gemv_triton(x, torch.zeros(8, 32, device=DEVICE, dtype=DTYPE), kernel="rows")


def test_gemv_strided_rows_and_leading_dims():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 2 * 64, generator=g).to(DEVICE, DTYPE)[..., :64]  # rows 128 apart
    w = torch.randn(48, 64, generator=g).to(DEVICE, DTYPE)
    got = gemv_triton(x, w)
    assert got.shape == (2, 3, 48)
    _close(got, F.linear(x, w))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "M,Ns,K", [(1, (17, 1, 40, 33, 5, 64), 100), (4, (48, 16), 64), (8, (8, 130, 3), 200)]
)
def test_gemv_many_matches_linear(M, Ns, K, kernel):
    """Several weights in one launch: each output its own weight's product, whatever the widths (a width of 1,
    widths that split a tile, more than one tile), over leading dims."""
    _skip_unless_taken(kernel, 2 * M)
    g = torch.Generator().manual_seed(M + K)
    x = torch.randn(2, M, K, generator=g).to(DEVICE, DTYPE)[:, :M]
    ws = [torch.randn(n, K, generator=g).to(DEVICE, DTYPE) for n in Ns]
    outs = gemv_many_triton(x, ws, kernel=kernel)
    assert len(outs) == len(ws)
    for got, w in zip(outs, ws):
        assert got.shape == (2, M, w.shape[0]) and got.is_contiguous()
        _close(got, F.linear(x, w))


@pytest.mark.parametrize("M,K,G", [(1, 64, 16), (3, 96, 32), (4, 40, 8), (2, 64, None), (1, 100, None)])
def test_gemv_rows_takes_the_output_gate(M, K, G):
    """The rows kernel with the output gate in its prologue against the gate's own op, then F.linear: KDA's
    per-head norm-gate (groups of G columns, K not a power of two included) and MLA's sigmoid gate."""
    from kestrel.ops.activation.naive import sigmoid_gate
    from kestrel.ops.kda.naive import gated_rms_norm

    g = torch.Generator().manual_seed(M * 100 + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, DTYPE)
    gate = (2 * torch.randn(2, M, K, generator=g)).to(DEVICE, DTYPE)[1]  # its own row stride
    w = torch.randn(37, K, generator=g).to(DEVICE, DTYPE)
    if G is None:
        h, norm = sigmoid_gate(x, gate), None
    else:
        norm_w = (torch.rand(G, generator=g) + 0.5).to(DEVICE, DTYPE)
        h = gated_rms_norm(x.view(M, K // G, G), gate.view(M, K // G, G), norm_w, 1e-5).view(M, K)
        norm = (norm_w, 1e-5)
    got = gemv_triton(x, w, kernel="rows", rows_block_n=8, gate=gate, norm=norm)
    _close(got, F.linear(h, w))
    walked = gemv_triton(x, w, kernel="rows", rows_block_n=8, gate=gate, norm=norm, rows_programs=2)
    assert torch.equal(walked, got)
    with pytest.raises(AssertionError, match="the rows kernel only"):
        gemv_triton(x, w, kernel="dot", gate=gate)


@pytest.mark.parametrize("programs", [None, 2])
@pytest.mark.parametrize("dtype", [DTYPE, torch.bfloat16], ids=["native", "bf16"])
@pytest.mark.parametrize("M,block_n", [(1, 8), (3, 4), (2, 64)])
def test_gemv_rows_takes_the_conv_step(M, block_n, dtype, programs):
    """The rows kernel with KDA's short-conv decode step on its first C output columns against the projection,
    then the conv step's own kernel (triton_conv.conv_step_inplace): the same output, the same planes, the same
    windows advanced in the pool (slots out of order, one slot of the pool untouched); in bf16 too, where the
    conv takes the projection's output as rounded to it."""
    from kestrel.ops.kda.triton_conv import conv_step_inplace

    P, W, K, N = 12, 4, 40, 3 * 12 + 7  # q|k|v of 12 channels each, then 7 more outputs (f_a, b, gate)
    g = torch.Generator().manual_seed(M + block_n)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    conv_w = torch.randn(3 * P, W, generator=g).to(DEVICE, dtype)
    pool = torch.randn(M + 1, 3 * P, W - 1, generator=g).to(DEVICE, dtype)
    slots = torch.randperm(M + 1, generator=g)[:M].to(DEVICE)
    want_pool = pool.clone()
    want_out = gemv_triton(x, w, kernel="rows", rows_block_n=block_n)
    want_planes = conv_step_inplace(want_out[:, : 3 * P], conv_w, want_pool, slots, planes=3)
    planes = torch.full((3, M, P), float("nan"), device=DEVICE, dtype=dtype)
    got = gemv_triton(
        x, w, kernel="rows", rows_block_n=block_n, rows_programs=programs, conv=(conv_w, pool, slots, planes)
    )
    assert torch.equal(got, want_out)
    assert torch.equal(planes, want_planes)
    assert torch.equal(pool, want_pool)
    with pytest.raises(AssertionError, match="one weight"):
        gemv_many_triton(x, [w, w], kernel="rows", conv=(conv_w, pool, slots, planes))


def test_layers_take_their_output_gate_inside_the_gemv(monkeypatch):
    """KDA's norm-gate and MLA's sigmoid gate inside the o projection's GEMV (where `fused_gemv_applies`: forced
    here; on the CPU, the interpreter) give the tiny model's logits of the gates' own ops, through 4 KDA and 2 MLA
    layers, on the tests' device."""
    import kestrel.layers.kda as kda_layer
    import kestrel.layers.mla as mla_layer
    from kestrel.models.loader import build_model

    model = build_model("tiny", seed=3, device=DEVICE, dtype=DTYPE)
    ids = torch.tensor([5, 17, 99], device=DEVICE)
    with torch.no_grad():
        want = model(ids)
    calls = []

    def spy(x, gate, weight, norm=None):
        calls.append(norm is not None)
        return linear_ops.linear_gated(x, gate, weight, norm)

    for module in (kda_layer, mla_layer):
        monkeypatch.setattr(module, "fused_gemv_applies", lambda fusion, x, w, group=1: fusion == "gate")
        monkeypatch.setattr(module, "linear_gated", spy)
    with torch.no_grad():
        got = model(ids)
    assert sorted(calls) == [False] * 2 + [True] * 4  # 2 MLA layers (no norm), 4 KDA layers
    # bf16 on CUDA: the norm's sum in another order may move a gated value by its last bit, 6 layers deep
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= (2e-2 if DTYPE == torch.bfloat16 else 1e-5), err


def test_fused_gemv_fuse_auto_takes_the_gate_at_one_row(monkeypatch):
    """KESTREL_GEMV_FUSE=auto (the default): the gate inside the rows GEMV at one row, nothing at two, never the
    conv step; none: nothing. The GEMV's own conditions (a Hopper GPU) are taken as met."""
    monkeypatch.setattr(linear_ops, "gemv_applies", lambda x, w: True)
    monkeypatch.setenv("KESTREL_GEMV", "auto")
    w = torch.zeros(8, 64)
    one, two = torch.zeros(1, 64), torch.zeros(2, 64)
    monkeypatch.delenv("KESTREL_GEMV_FUSE", raising=False)
    assert linear_ops.fused_gemv_applies("gate", one, w)
    assert not linear_ops.fused_gemv_applies("gate", two, w)
    assert not linear_ops.fused_gemv_applies("conv", one, w)
    monkeypatch.setenv("KESTREL_GEMV_FUSE", "none")
    assert not linear_ops.fused_gemv_applies("gate", one, w)
    monkeypatch.setenv("KESTREL_GEMV_FUSE", "gate")
    assert linear_ops.fused_gemv_applies("gate", two, w)
    monkeypatch.setenv("KESTREL_GEMV", "dot")
    assert not linear_ops.fused_gemv_applies("gate", one, w)


def test_fused_gemv_applies_only_where_asked(monkeypatch):
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("KESTREL_GEMV", "rows")
    monkeypatch.setenv("KESTREL_GEMV_FUSE", "all")
    assert not linear_ops.fused_gemv_applies("gate", x, w)  # the CPU: never
    if torch.cuda.is_available():
        from kestrel.ops.pdl import pdl_args

        xc, wc = x.cuda(), w.cuda()
        tuned = bool(pdl_args(xc))
        assert (
            linear_ops.fused_gemv_applies("gate", xc, wc)
            == linear_ops.fused_gemv_applies("conv", xc, wc)
            == tuned
        )
        assert not linear_ops.fused_gemv_applies("gate", xc.expand(ROWS_MAX_M + 1, 64), wc)
        monkeypatch.setenv("KESTREL_GEMV_FUSE", "conv")
        assert not linear_ops.fused_gemv_applies("gate", xc, wc)
        assert linear_ops.fused_gemv_applies("conv", xc, wc) == tuned
        monkeypatch.setenv("KESTREL_GEMV_FUSE", "none")
        assert not linear_ops.fused_gemv_applies("conv", xc, wc)
        monkeypatch.setenv("KESTREL_GEMV_FUSE", "all")
        monkeypatch.setenv("KESTREL_GEMV", "auto")
        assert linear_ops.fused_gemv_applies("gate", xc, wc) == tuned
        assert not linear_ops.fused_gemv_applies("gate", xc.expand(ROWS_AUTO_M + 1, 64), wc)
        monkeypatch.setenv("KESTREL_GEMV", "dot")
        assert not linear_ops.fused_gemv_applies("gate", xc, wc)


def test_gemv_many_refuses_what_it_cannot_take():
    x = torch.zeros(1, 32, device=DEVICE, dtype=DTYPE)
    w = torch.zeros(8, 32, device=DEVICE, dtype=DTYPE)
    with pytest.raises(AssertionError, match="one launch takes"):
        gemv_many_triton(x, [w] * (SEGMENTS + 1))
    with pytest.raises(AssertionError, match="for width 32"):
        gemv_many_triton(x, [w, torch.zeros(8, 16, device=DEVICE, dtype=DTYPE)])


def test_linear_many_merges_one_input_only(monkeypatch):
    """One launch where every pair reads one tensor's data and the GEMV applies to each; else a linear a pair
    (a launch of one weight, not counted), and a detached input keeps its weight's gradient away from x."""
    from kestrel.ops.linear import triton_gemv

    launches = []
    real = triton_gemv.gemv_many_triton
    monkeypatch.setattr(
        triton_gemv,
        "gemv_many_triton",
        lambda x, ws: launches.extend([len(ws)] * (len(ws) > 1)) or real(x, ws),
    )
    monkeypatch.setattr(linear_ops, "gemv_applies", lambda x, w: not torch.is_grad_enabled())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=g).to(DEVICE, DTYPE)
    ws = [torch.randn(n, 64, generator=g).to(DEVICE, DTYPE) for n in (24, 8, 40)]
    with torch.no_grad():
        outs = linear_ops.linear_many([(x, ws[0]), (x.detach(), ws[1]), (x, ws[2])])
        assert launches == [3]
        for got, w in zip(outs, ws):
            _close(got, F.linear(x, w))
        linear_ops.linear_many([(x, ws[0]), (x.clone(), ws[1])])  # two inputs: two linears
        assert launches == [3]
    xg = x.clone().requires_grad_()
    a, b = linear_ops.linear_many([(xg, ws[0]), (xg.detach(), ws[1])])  # autograd records: one linear each
    assert launches == [3] and a.requires_grad and not b.requires_grad


def test_linear_picks_the_gemv_only_where_it_applies(monkeypatch):
    from kestrel.ops.pdl import pdl_args

    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert not linear_ops.gemv_applies(x, w)  # the CPU: F.linear
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        tuned = bool(pdl_args(xc))  # Hopper: the GEMV's setup
        assert linear_ops.gemv_applies(xc, wc) == tuned
        assert not linear_ops.gemv_applies(torch.zeros(17, 16, dtype=torch.bfloat16, device="cuda"), wc)
        assert not linear_ops.gemv_applies(xc.float(), wc.float())
        assert not linear_ops.gemv_applies(xc, wc.half())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert not linear_ops.gemv_applies(xc, wc)
        assert not linear_ops.gemv_applies(xc, wc.clone().requires_grad_())  # autograd records: cuBLAS
        with torch.no_grad():
            assert linear_ops.gemv_applies(xc, wc.clone().requires_grad_()) == tuned
        monkeypatch.setenv("KESTREL_GEMV", "off")
        assert not linear_ops.gemv_applies(xc, wc)


@cuda
def test_linear_layer_routes_to_the_gemv(monkeypatch):
    from kestrel.layers.linear import Linear
    from kestrel.ops.linear import triton_gemv
    from kestrel.ops.pdl import pdl_args

    calls = []
    real = triton_gemv.gemv_triton
    monkeypatch.setattr(triton_gemv, "gemv_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = Linear(256, 96, dtype=torch.bfloat16).cuda()
    torch.nn.init.normal_(layer.weight, std=0.05)
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
    _close(got, F.linear(x, layer.weight))
    assert len(calls) == (1 if pdl_args(x) else 0)


@cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("N,K", [(3072, 2048), (576, 2048), (2048, 1024), (8, 2048), (4232, 2048), (7, 3000)])
def test_gemv_mini_shapes(M, N, K, kernel):
    _skip_unless_taken(kernel, M)
    g = torch.Generator(device="cuda").manual_seed(M + N)
    w = torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    _close(gemv_triton(x, w, kernel=kernel), F.linear(x, w))


@cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("K", [1024, 2048])
def test_gemv_chain_in_a_graph(M, K, kernel):
    """As in a decode step: RMSNorm, then the GEMV, twice over, each kernel reading the one before (with PDL: the
    GEMV's prefetch before its wait, the norm's wait); a graph replay on fresh inputs against eager."""
    from kestrel.ops.norm.triton_norm import rms_norm_triton
    from tests.ops.graph_check import assert_replay_matches_eager

    _skip_unless_taken(kernel, M)
    g = torch.Generator(device="cuda").manual_seed(M + K)
    w1, w2 = (torch.randn(K, K, generator=g, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(2))
    norm_w = torch.rand(K, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5

    def chain(a):
        h = gemv_triton(rms_norm_triton(a, norm_w, 1e-6), w1, kernel=kernel)
        return gemv_triton(rms_norm_triton(h, norm_w, 1e-6), w2, kernel=kernel)

    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    want = F.linear(F.rms_norm(F.linear(F.rms_norm(x.float(), (K,), norm_w.float(), 1e-6).bfloat16(), w1).float(),
                               (K,), norm_w.float(), 1e-6).bfloat16(), w2)  # fmt: skip
    _close(chain(x), want)
    assert_replay_matches_eager(chain, [x.clone()], [torch.randn_like(x)])


@cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_gemv_many_mla_shapes_in_a_graph(M, kernel):
    """mini's MLA projections of x in one launch after an RMSNorm (q, kv_a, g, the indexer's q, k, weights), a
    graph replay on fresh inputs against eager, and each output against F.linear."""
    from kestrel.ops.norm.triton_norm import rms_norm_triton
    from tests.ops.graph_check import assert_replay_matches_eager

    _skip_unless_taken(kernel, M)
    K = 2048
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [
        torch.randn(n, K, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
        for n in (3072, 576, 2048, 2048, 128, 16)
    ]
    norm_w = torch.rand(K, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5

    def step(a):
        return tuple(gemv_many_triton(rms_norm_triton(a, norm_w, 1e-6), ws, kernel=kernel))

    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    h = F.rms_norm(x.float(), (K,), norm_w.float(), 1e-6).bfloat16()
    for got, w in zip(step(x), ws):
        _close(got, F.linear(h, w))
    assert_replay_matches_eager(step, [x.clone()], [torch.randn_like(x)])


@cuda
@pytest.mark.parametrize("M", [1, 2, 4])
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_gemv_rows_output_gate_mini_shapes_in_a_graph(M, kind):
    """mini's o projections with their gates inside the rows GEMV: KDA's (2048 x 1024, the norm-gate over heads
    of 128, the gate a view of the in-projection's rows) and MLA's (2048 x 2048, sigmoid gate), against the
    gates' own kernels then F.linear, and a graph replay on fresh inputs against eager."""
    from kestrel.ops.activation import sigmoid_gate
    from kestrel.ops.kda import gated_rms_norm
    from tests.ops.graph_check import assert_replay_matches_eager

    K = 1024 if kind == "kda" else 2048
    g = torch.Generator(device="cuda").manual_seed(M)
    w = torch.randn(2048, K, generator=g, device="cuda", dtype=torch.bfloat16) * K**-0.5
    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(M, 4232, generator=g, device="cuda", dtype=torch.bfloat16)
    gate = rows[:, 1000 : 1000 + K]  # strided rows, as the in-projection's split leaves them
    norm = None
    if kind == "kda":
        norm = (torch.rand(128, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5)
        h = gated_rms_norm(x.view(M, -1, 128), gate.reshape(M, -1, 128), *norm).view(M, K)
    else:
        h = sigmoid_gate(x.view(M, 16, 128), gate).view(M, K)

    def step(a):
        return gemv_triton(a, w, kernel="rows", gate=gate, norm=norm)

    _close(step(x), F.linear(h, w))
    # against the gate's own kernel, then the same GEMV: MLA's bit for bit (the same roundings); KDA's within
    # its norm's last bit (its sum over each head reduced in another order)
    unfused = gemv_triton(h, w, kernel="rows")
    if kind == "mla":
        assert torch.equal(step(x), unfused)
    else:
        torch.testing.assert_close(
            step(x).float(), unfused.float(), rtol=0, atol=2e-3 * unfused.abs().max().item()
        )
    assert_replay_matches_eager(step, [x.clone()], [torch.randn_like(x)])


@cuda
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_rows_conv_step_mini_shapes_in_a_graph(M):
    """mini's KDA input projection (4232 x 2048, q|k|v the first 3072 columns) with the conv step in its epilogue
    against the GEMV then triton_conv's kernel: the same projection, planes and windows; and a graph replay on
    fresh inputs against eager (each call from the same windows)."""
    from kestrel.ops.kda.triton_conv import conv_step_inplace
    from tests.ops.graph_check import assert_replay_matches_eager

    g = torch.Generator(device="cuda").manual_seed(M)
    w = torch.randn(4232, 2048, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    conv_w = torch.randn(3072, 4, generator=g, device="cuda", dtype=torch.bfloat16) * 0.5
    pool = torch.randn(8, 3072, 3, generator=g, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([5, 2, 7][:M], device="cuda", dtype=torch.int32)
    x = torch.randn(M, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    want_pool = pool.clone()
    want_out = gemv_triton(x, w, kernel="rows")
    want_planes = conv_step_inplace(want_out[:, :3072], conv_w, want_pool, slots, planes=3)
    planes = torch.empty(3, M, 1024, device="cuda", dtype=torch.bfloat16)
    got = gemv_triton(x, w, kernel="rows", conv=(conv_w, pool, slots, planes))
    assert torch.equal(got, want_out) and torch.equal(pool, want_pool)
    assert torch.equal(planes, want_planes)  # one conv_window_step in both

    start = pool.clone()

    def step(a):
        pool.copy_(start)
        p = torch.empty(3, M, 1024, device="cuda", dtype=torch.bfloat16)
        return gemv_triton(a, w, kernel="rows", conv=(conv_w, pool, slots, p)), p, pool.clone()

    assert_replay_matches_eager(step, [x.clone()], [torch.randn_like(x)])
