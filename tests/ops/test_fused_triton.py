"""The one-kernel Triton forms of the small fp32 ops (RMSNorm, SwiGLU / SiTU, AttnRes mixing) against their
plain-torch references. Without CUDA they run under TRITON_INTERPRET=1 on CPU (set here, before triton is first
imported); with CUDA the same cases run compiled. Outputs are fresh tensors, so a row the kernel never writes
would hold garbage and fail the comparison."""

from __future__ import annotations

import pytest
import torch

from tests.ops.kernel_modules import load_kernels as _load  # sets TRITON_INTERPRET without CUDA

triton = pytest.importorskip("triton")

from kestrel.ops.activation.naive import sigmoid_gate, situ, swiglu  # noqa: E402
from kestrel.ops.attnres.naive import attnres_mix, attnres_mix_norm  # noqa: E402
from kestrel.ops.kda.naive import gated_rms_norm, kda_gate  # noqa: E402
from kestrel.ops.norm.naive import layer_norm, rms_norm  # noqa: E402

_act = _load("kestrel.ops.activation.triton_act")
situ_triton, swiglu_triton, sigmoid_gate_triton = (
    _act.situ_triton,
    _act.swiglu_triton,
    _act.sigmoid_gate_triton,
)
_mix = _load("kestrel.ops.attnres.triton_mix")
attnres_mix_triton, attnres_mix_norm_triton = _mix.attnres_mix_triton, _mix.attnres_mix_norm_triton
_norm = _load("kestrel.ops.norm.triton_norm")
rms_norm_triton, gated_rms_norm_triton = _norm.rms_norm_triton, _norm.gated_rms_norm_triton
layer_norm_triton = _norm.layer_norm_triton
kda_gate_triton = _load("kestrel.ops.kda.triton_gate").kda_gate_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (5, 100), (2, 3, 128), (3, 1000)])
def test_layer_norm_matches_reference(dtype, shape):
    """The DSA indexer's key norm (128 wide on mini; 1000: 4 warps on the GPU); rows off zero mean, so the
    centering matters."""
    x = _randn(*shape, dtype=dtype, seed=11, scale=3.0) + 2.0
    w, b = _randn(shape[-1], dtype=dtype, seed=12), _randn(shape[-1], dtype=dtype, seed=13)
    got = layer_norm_triton(x, w, b, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, layer_norm.eager(x, w, b, 1e-6), **TOL[dtype])
    rows = torch.cat([x.reshape(-1, shape[-1]), x.reshape(-1, shape[-1])], dim=1)[:, : shape[-1] + 8]
    strided = rows[:, : shape[-1]]  # rows wider apart than D
    torch.testing.assert_close(
        layer_norm_triton(strided, w, b, 1e-6), layer_norm.eager(strided, w, b, 1e-6), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (5, 100), (2, 3, 64)])
def test_rms_norm_matches_reference(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=1, scale=3.0)
    w = _randn(shape[-1], dtype=dtype, seed=2)
    got = rms_norm_triton(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm.eager(x, w, 1e-6), **TOL[dtype])


def test_rms_norm_of_strided_rows():
    """MLA normalizes the latent part of a [T, R + P] projection: rows with a stride wider than D."""
    full = _randn(6, 40 + 8, dtype=torch.float32, seed=3)
    x = full[:, :40]
    assert not x.is_contiguous()
    w = _randn(40, dtype=torch.float32, seed=4)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5), rms_norm.eager(x, w, 1e-5), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_reference(dtype):
    o = _randn(2, 3, 5, 24, dtype=dtype, seed=11, scale=2.0)  # [B, T, H, V]
    gate = _randn(2, 3, 5, 24, dtype=dtype, seed=12, scale=4.0)
    w = _randn(24, dtype=dtype, seed=13)
    got = gated_rms_norm_triton(o, gate, w, 1e-5)
    torch.testing.assert_close(got, gated_rms_norm.eager(o, gate, w, 1e-5), **TOL[dtype])


def test_gated_rms_norm_reads_a_gate_sliced_from_a_wider_projection():
    """KDA's output gate is the last columns of its merged input projection: [T, H, V] heads with a token stride
    wider than H * V, read in place."""
    T, H, V = 7, 3, 16
    full = _randn(T, 5 + H * V, dtype=torch.float32, seed=21)
    gate = full[:, 5:].view(T, H, V)
    assert gate.stride() == (5 + H * V, V, 1)
    o = _randn(T, H, V, dtype=torch.float32, seed=22, scale=2.0)
    w = _randn(V, dtype=torch.float32, seed=23)
    got = gated_rms_norm_triton(o, gate, w, 1e-5)
    torch.testing.assert_close(got, gated_rms_norm.eager(o, gate, w, 1e-5), **TOL[torch.float32])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gate_matches_reference(lower_bound, dtype):
    H, K = 3, 20
    f = _randn(4, 1, H, K, dtype=dtype, seed=14, scale=15.0)  # softplus past its threshold of 20 too
    a_log = _randn(H, dtype=torch.float32, seed=15)
    bias = _randn(H * K, dtype=torch.float32, seed=16)
    got = kda_gate_triton(f, a_log, bias, lower_bound)
    assert got.dtype == torch.float32 and got.shape == f.shape
    torch.testing.assert_close(got, kda_gate.eager(f, a_log, bias, lower_bound), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 24), (7, 130)])
def test_glu_activations_match_reference(dtype, rows, width):
    gate_up = _randn(rows, 2 * width, dtype=dtype, seed=width, scale=6.0)  # past SiTU's caps (beta 4)
    gate, up = gate_up.chunk(2, dim=-1)  # strided views, as glu_act passes them
    torch.testing.assert_close(swiglu_triton(gate, up), swiglu.eager(gate, up), **TOL[dtype])
    torch.testing.assert_close(
        situ_triton(gate, up, 4.0, 25.0), situ.eager(gate, up, 4.0, 25.0), **TOL[dtype]
    )


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid(-1e4), on numpy
def test_situ_near_zero_and_far_out():
    """The tanh inside: its series near 0 and its exponential form far out (where exp overflows to inf)."""
    a = torch.tensor([[0.0, 1e-6, -1e-3, 0.1249, 0.1251, -0.5, 3.0, -40.0, 90.0, 1e4, -1e4]], device=DEVICE)
    b = torch.flip(a, dims=[-1]) * 7
    torch.testing.assert_close(
        situ_triton(a, b, 4.0, 25.0), situ.eager(a, b, 4.0, 25.0), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,T,D", [(2, 1, 40), (3, 5, 64), (5, 3, 100)])
def test_attnres_mix_matches_reference(dtype, S, T, D):
    sources = _randn(S, T, D, dtype=dtype, seed=S * D, scale=2.0)
    query = _randn(D, dtype=dtype, seed=7, scale=0.5)
    weight = _randn(D, dtype=dtype, seed=8)
    got = attnres_mix_triton(sources, query, weight, 1e-6)
    assert got.shape == (T, D) and got.dtype == dtype
    torch.testing.assert_close(got, attnres_mix.eager(sources, query, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,T,D", [(2, 1, 40), (3, 5, 64), (5, 3, 100), (5, 2, 2048)])
def test_attnres_mix_norm_matches_reference(dtype, S, T, D):
    """The mix and the consumer's RMSNorm in one kernel: the reference is the two ops in a row. (5, 2, 2048) is
    mini's widest mix: an [8, 2048] tile over 8 warps on the GPU."""
    sources = _randn(S, T, D, dtype=dtype, seed=S * D + 1, scale=2.0)
    query = _randn(D, dtype=dtype, seed=11, scale=0.5)
    weight, out_weight = _randn(D, dtype=dtype, seed=12), _randn(D, dtype=dtype, seed=13)
    got = attnres_mix_norm_triton(sources, query, weight, 1e-6, out_weight, 1e-5)
    ref = attnres_mix_norm.eager(sources, query, weight, 1e-6, out_weight, 1e-5)
    assert got.shape == (T, D) and got.dtype == dtype
    # 2048 wide, the logits' fp32 sums (in another order) reach ~1e-6 relative of logits near 20: ~2e-5 out
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 and D > 1024 else TOL[dtype]
    torch.testing.assert_close(got, ref, **tol)
    two = rms_norm.eager(attnres_mix.eager(sources, query, weight, 1e-6), out_weight, 1e-5)
    assert torch.equal(ref, two)  # the reference is exactly the two ops
    # the last source given apart (training's running sum), here a strided view of a wider tensor
    wide = torch.cat([sources[-1], sources[-1]], dim=-1)[:, :D]  # [T, D], row stride 2D
    apart = attnres_mix_norm_triton(sources[:-1], query, weight, 1e-6, out_weight, 1e-5, last=wide)
    assert torch.equal(apart, got)
    assert torch.equal(attnres_mix_norm.eager(sources[:-1], query, weight, 1e-6, out_weight, 1e-5, wide), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("S,T,D", [(2, 1, 40), (3, 5, 64), (5, 2, 2048)])
def test_attnres_mix_norm_takes_the_update_in_place(dtype, accumulate, S, T, D):
    """A sublayer's output added to (or copied over) the last source as the kernel reads the sources: the same
    buffer afterwards as torch's add_ / copy_ (bit for bit: one rounding of the fp32 sum), the untouched sources
    the same, and the mix of the updated sources; the buffer's rows past T (another batch's) left alone."""
    buf = _randn(S, T + 2, D, dtype=dtype, seed=S + T + D, scale=2.0)
    update = _randn(T, D, dtype=dtype, seed=D, scale=1.5)
    query = _randn(D, dtype=dtype, seed=21, scale=0.5)
    weight, out_weight = _randn(D, dtype=dtype, seed=22), _randn(D, dtype=dtype, seed=23)
    want_buf = buf.clone()
    ref = attnres_mix_norm.eager(
        want_buf[:, :T], query, weight, 1e-6, out_weight, 1e-5, update=update, accumulate=accumulate
    )
    if accumulate:
        assert torch.equal(want_buf[-1, :T], (buf[-1, :T].float() + update.float()).to(dtype))
    else:
        assert torch.equal(want_buf[-1, :T], update)
    got = attnres_mix_norm_triton(
        buf[:, :T], query, weight, 1e-6, out_weight, 1e-5, update=update, accumulate=accumulate
    )
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(buf, want_buf)
    else:  # Triton's interpreter rounds fp32 to bf16 toward zero (the GPU to nearest even): one ulp apart at most
        torch.testing.assert_close(buf, want_buf, rtol=2**-7, atol=0)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 and D > 1024 else TOL[dtype]
    torch.testing.assert_close(got, ref, **tol)
    fresh = attnres_mix_norm_triton(buf[:, :T].contiguous(), query, weight, 1e-6, out_weight, 1e-5)
    assert torch.equal(got, fresh)  # the same kernel's mix of the sources it updated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D", [(1, 2, 8), (37, 3, 64), (300, 4, 40)])  # 300 x 160 spans two programs
def test_sigmoid_gate_matches_reference(dtype, T, H, D):
    x = _randn(T, H, D, dtype=dtype, seed=T + H, scale=2.0)
    gate = _randn(T, H * D, dtype=dtype, seed=T * H, scale=4.0)  # as the gate projection's output comes
    got = sigmoid_gate_triton(x, gate)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, sigmoid_gate.eager(x, gate), **TOL[dtype])


def test_fused_ops_dispatch():
    """Under no_grad on CUDA the op runs its Triton kernel (unless KESTREL_FUSED_OPS=off); elsewhere the reference;
    whenever autograd records, a differentiable op (the reference, or on CUDA its compiled form: test_fuse.py)."""
    x = _randn(3, 48, dtype=torch.float32, seed=9)
    w = _randn(48, dtype=torch.float32, seed=10)
    assert rms_norm.fast().__qualname__ == "rms_norm_triton"
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6), **TOL[torch.float32])
    w.requires_grad_(True)
    y = rms_norm(x, w, 1e-6)  # autograd records: differentiable
    assert y.requires_grad
    y.sum().backward()
    assert w.grad is not None
