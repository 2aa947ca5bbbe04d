"""KDA references: chunked == recurrent (fp64, odd lengths, varlen, initial states), agreement with fla-core's
own torch references, the conv / gate / norm helpers, the fla fast path on CUDA, and the backend registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.ops.kda import (
    chunk_kda,
    gated_rms_norm,
    get_kda_backend,
    kda_gate,
    l2norm,
    recurrent_kda,
    short_conv,
    short_conv_step,
)
from kestrel.utils.errors import ConfigError
from tests.ops.graph_check import assert_replay_matches_eager

H, K, V = 2, 16, 32


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make_inputs(
    T, B=1, N=None, lower_bound=None, dtype=torch.float64, device="cpu", heads=H, k_dim=K, v_dim=V
):
    """Random KDA inputs [B, T, ...], a gate from `kda_gate`, an initial state for N sequences (default B).
    k is scaled to unit-ish norm so the delta rule stays stable even without in-kernel l2norm."""
    gen = torch.Generator().manual_seed(1234 + T)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(device=device, dtype=dtype)

    q = randn(B, T, heads, k_dim)
    k = randn(B, T, heads, k_dim, std=k_dim**-0.5)
    v = randn(B, T, heads, v_dim)
    f = randn(B, T, heads, k_dim)
    A_log = (
        torch.rand(heads, generator=gen, dtype=torch.float64).mul(15).add(1).log().to(device)
    )  # log U(1, 16)
    dt_bias = randn(heads * k_dim, std=0.5).to(torch.float32)
    g = kda_gate(f, A_log, dt_bias, lower_bound).to(dtype)
    beta = torch.rand(B, T, heads, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    h0 = randn(N or B, heads, k_dim, v_dim, std=0.5).to(torch.float32 if dtype != torch.float64 else dtype)
    return q, k, v, g, beta, h0


# ---------------------------------------------------------------- chunked form == recurrence (fp64)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("T, chunk_size", [(37, 16), (150, 64), (70, 48)])
def test_chunk_equals_recurrent_fp64(lower_bound, use_qk_l2norm, T, chunk_size):
    """The chunked form against the recurrence, at the default chunk of 64 and others, T not their multiple."""
    q, k, v, g, beta, h0 = make_inputs(T=T, B=2, lower_bound=lower_bound)
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=use_qk_l2norm)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, **kwargs)
    o, s = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert o.shape == v.shape and s.shape == h0.shape
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(s, s_ref) < 1e-10


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_varlen_equals_per_sequence(use_qk_l2norm):
    lens = [7, 16, 0, 29, 1]
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta, h0 = make_inputs(T=sum(lens), N=len(lens), lower_bound=-5.0)
    kwargs = dict(output_final_state=True, use_qk_l2norm=use_qk_l2norm)

    o_ref, s_ref = torch.empty_like(v), torch.empty_like(h0)
    for n, (bos, eos) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        tokens = slice(bos, eos)
        o_ref[:, tokens], s_ref[n : n + 1] = recurrent_kda(
            q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens],
            initial_state=h0[n : n + 1], **kwargs,
        )  # fmt: skip

    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, **kwargs)
    o_chk, s_chk = chunk_kda(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, chunk_size=16, **kwargs
    )
    assert rel_err(o_rec, o_ref) < 1e-12 and rel_err(s_rec, s_ref) < 1e-12
    assert rel_err(o_chk, o_ref) < 1e-10 and rel_err(s_chk, s_ref) < 1e-10
    torch.testing.assert_close(s_chk[2], h0[2], rtol=0, atol=0)  # an empty sequence keeps its state


def test_state_dtype_and_no_final_state():
    q, k, v, g, beta, h0 = make_inputs(T=9, B=2, dtype=torch.bfloat16)
    for op in (recurrent_kda, chunk_kda):
        o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        _, none = op(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
        assert none is None


def test_prefill_then_decode_continues_the_state():
    q, k, v, g, beta, h0 = make_inputs(T=40, lower_bound=-5.0)
    kwargs = dict(output_final_state=True, use_qk_l2norm=True)
    o_full, s_full = recurrent_kda(q, k, v, g, beta, initial_state=h0, **kwargs)
    o1, s1 = chunk_kda(*(x[:, :33] for x in (q, k, v, g, beta)), initial_state=h0, chunk_size=16, **kwargs)
    o2, s2 = recurrent_kda(*(x[:, 33:] for x in (q, k, v, g, beta)), initial_state=s1, **kwargs)
    assert rel_err(torch.cat([o1, o2], 1), o_full) < 1e-10
    assert rel_err(s2, s_full) < 1e-10


# ---------------------------------------------------------------- fla-core's torch references


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_matches_fla_naive_references(lower_bound):
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    # fla's references compute in fp32 and need T % chunk_size == 0 for the chunked one.
    q, k, v, g, beta, h0 = make_inputs(T=48, B=2, lower_bound=lower_bound, dtype=torch.float32)
    kwargs = dict(initial_state=h0, output_final_state=True)

    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, **kwargs)
    o, s = recurrent_kda(q, k, v, g, beta, **kwargs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5

    o_ref, s_ref = fla_naive.naive_chunk_kda(q, k, v, g, beta, chunk_size=16, **kwargs)
    o, s = chunk_kda(q, k, v, g, beta, chunk_size=16, **kwargs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5

    # fla's references take q, k already normalized; ours normalize with + eps inside the square root.
    def normalize(x):
        return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)

    o_ref, s_ref = fla_naive.naive_recurrent_kda(normalize(q), normalize(k), v, g, beta, **kwargs)
    o, s = chunk_kda(q, k, v, g, beta, chunk_size=16, use_qk_l2norm=True, **kwargs)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_kda_gate_matches_fla():
    fla_gate = pytest.importorskip("fla.ops.kda.gate")
    f = torch.randn(3, 5, H, K) * 3
    A_log = torch.rand(H).mul(15).add(1).log()
    dt_bias = torch.randn(H * K)

    ref = fla_gate.naive_kda_gate(f, A_log, dt_bias)
    assert rel_err(kda_gate(f, A_log, dt_bias), ref) < 1e-6
    assert rel_err(kda_gate(f, A_log.view(1, 1, H, 1), dt_bias), ref) < 1e-6  # Kimi-Linear's A_log layout

    ref = fla_gate.naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0)
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float32 and rel_err(g, ref) < 1e-6
    assert g.min() >= -5.0 and g.max() <= 0  # the sigmoid saturates to exactly lb or 0 in fp32


# ---------------------------------------------------------------- helpers: conv, l2norm, output norm


def conv1d_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fla's ShortConvolution: Conv1d(groups=C, padding=W-1) truncated to T outputs, then SiLU."""
    T, C = x.shape
    W = weight.shape[-1]
    y = F.conv1d(x.T[None], weight[:, None, :], groups=C, padding=W - 1)[0, :, :T]  # [C, T]
    return F.silu(y).T


def test_short_conv_matches_conv1d():
    x, weight = torch.randn(11, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y, state = short_conv(x, weight)
    assert rel_err(y, conv1d_silu(x, weight)) < 1e-12
    torch.testing.assert_close(state, x[-3:].T[None], rtol=0, atol=0)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_short_conv_split_with_carried_state(split):
    x, weight = torch.randn(11, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    y_full, state_full = short_conv(x, weight)
    y1, state = short_conv(x[:split], weight)
    y2, state = short_conv(x[split:], weight, state)
    assert rel_err(torch.cat([y1, y2]), y_full) < 1e-12
    torch.testing.assert_close(state, state_full, rtol=0, atol=0)


def test_short_conv_varlen_with_initial_states():
    lens, C, W = [5, 1, 0, 8], 6, 4
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, weight = torch.randn(sum(lens), C, dtype=torch.float64), torch.randn(C, W, dtype=torch.float64)
    state0 = torch.randn(len(lens), C, W - 1, dtype=torch.float64)
    y, state = short_conv(x, weight, state0, cu_seqlens)
    for n, (bos, eos) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        history = torch.cat([state0[n].T, x[bos:eos]])  # [W - 1 + L, C]
        if eos > bos:
            assert rel_err(y[bos:eos], conv1d_silu(history, weight)[W - 1 :]) < 1e-12
        torch.testing.assert_close(state[n], history[-(W - 1) :].T, rtol=0, atol=0)


def test_l2norm_and_gated_rms_norm():
    x = torch.randn(4, 3, V, dtype=torch.bfloat16)
    xf = x.float()
    torch.testing.assert_close(l2norm(x), xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6))

    gate, weight = torch.randn(4, 3, V, dtype=torch.bfloat16), torch.randn(V)
    ref = weight * xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.sigmoid(gate.float())
    out = gated_rms_norm(x, gate, weight, eps=1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.to(torch.bfloat16))


# ---------------------------------------------------------------- fla fast path on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("lens", [[1, 63, 64, 130, 300], [1] * 8], ids=["prefill", "decode"])
@pytest.mark.parametrize("recurrent_prefill", ["0", "1024"], ids=["chunked", "short-recurrent"])
def test_fla_backend_matches_naive(op, lower_bound, lens, recurrent_prefill, monkeypatch):
    """Both forms of fla's `chunk`: the chunked kernels, and the recurrent one it runs for a short prefill (given
    the gate's bound, as the model passes it)."""
    pytest.importorskip("fla.ops.kda")
    monkeypatch.setenv("KESTREL_KDA_RECURRENT_PREFILL", recurrent_prefill)
    from kestrel.ops.kda import fla

    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    q, k, v, g, beta, h0 = make_inputs(
        T=sum(lens), N=len(lens), lower_bound=lower_bound, dtype=torch.bfloat16, device="cuda",
        heads=4, k_dim=128, v_dim=128,
    )  # fmt: skip
    g = g.float()  # the gate stays fp32, as the model produces it
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu_seqlens)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, **kwargs)
    bound = dict(gate_lower_bound=lower_bound) if op == "chunk" else {}
    o, s = getattr(fla, op)(q, k, v, g, beta, **kwargs, **bound)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == h0.shape
    assert rel_err(o, o_ref) <= 2e-2
    assert rel_err(s, s_ref) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "disable_recompute,safe_gate", [(False, False), (True, False), (False, True), (True, True)]
)
def test_fla_chunk_gradients_match_the_reference(disable_recompute, safe_gate, monkeypatch):
    """Training runs fla's chunk_kda backward: its output, final state and gradients (q, k, v, g, beta, initial
    state) against autograd through the fp32 reference, on packed sequences, with and without fla's recompute and
    its bounded-gate kernels."""
    pytest.importorskip("fla.ops.kda")
    from kestrel.ops.kda import fla

    monkeypatch.setenv("KESTREL_KDA_SAFE_GATE", "1" if safe_gate else "0")
    lens = [5, 64, 130, 37]
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    inputs = make_inputs(
        T=sum(lens),
        N=len(lens),
        lower_bound=-5.0,
        dtype=torch.bfloat16,
        device="cuda",
        heads=2,
        k_dim=64,
        v_dim=64,
    )
    q, k, v, g, beta, h0 = (t.float() if i in (3, 4) else t for i, t in enumerate(inputs))  # gate, beta fp32
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    ref_leaves = [t.detach().float().clone().requires_grad_(True) for t in leaves]
    kwargs = dict(output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu_seqlens)
    o, s = fla.chunk(
        *leaves[:5],
        initial_state=leaves[5],
        disable_recompute=disable_recompute,
        gate_lower_bound=-5.0,
        **kwargs,
    )
    o_ref, s_ref = chunk_kda(*ref_leaves[:5], initial_state=ref_leaves[5], **kwargs)
    probe_o = torch.randn(o.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    probe_s = torch.randn(s.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    assert rel_err(o.float(), o_ref) <= 2e-2 and rel_err(s, s_ref) <= 2e-2  # the forward too
    grads = torch.autograd.grad((o.float() * probe_o).sum() + (s * probe_s).sum(), leaves)
    grads_ref = torch.autograd.grad((o_ref * probe_o).sum() + (s_ref * probe_s).sum(), ref_leaves)
    for name, a, b in zip("q k v g beta h0".split(), grads, grads_ref):
        assert rel_err(a.float(), b) <= 3e-2, name


# ---------------------------------------------------------------- backend registry


def test_backend_registry_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("KESTREL_KDA_BACKEND", "auto")
    assert get_kda_backend(cpu).name == "naive"
    monkeypatch.setenv("KESTREL_KDA_BACKEND", "naive")
    backend = get_kda_backend(cpu)
    assert backend.name == "naive" and backend.chunk is chunk_kda and backend.recurrent is recurrent_kda
    monkeypatch.setenv("KESTREL_KDA_BACKEND", "fla")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # with the interpreter on, fla runs on the CPU
    with pytest.raises(ConfigError, match="KESTREL_KDA_BACKEND=fla needs a CUDA device"):
        get_kda_backend(cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backend_registry_on_cuda(monkeypatch):
    pytest.importorskip("fla.ops.kda")
    monkeypatch.setenv("KESTREL_KDA_BACKEND", "auto")
    assert get_kda_backend(torch.device("cuda")).name == "fla"


# ---------------------------------------------------------------- batched decode conv step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("W", [4, 2, 1])
def test_short_conv_step_equals_short_conv(W, dtype):
    N, C = 5, 6
    g = torch.Generator().manual_seed(W)
    x, weight = torch.randn(N, C, generator=g, dtype=dtype), torch.randn(C, W, generator=g, dtype=dtype)
    state0 = torch.randn(N, C, W - 1, generator=g, dtype=dtype)
    y_ref, state_ref = short_conv(x, weight, state0, torch.arange(N + 1))  # N sequences of one token
    y, state = short_conv_step(x, weight, state0)
    assert y.shape == (N, C) and state.shape == (N, C, W - 1) and y.dtype == state.dtype == dtype
    # to 2 eps: the window's sum runs over a contiguous [N, C, W] here and over unfold's strided windows there
    # (1 of 30 values 1 ulp apart for some inputs, float64 too); the state is a copy: exact
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(y, y_ref, rtol=2 * ulp, atol=2 * ulp)
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)


def test_short_conv_step_decodes_a_sequence_and_keeps_state_dtype():
    # Token-by-token steps from a prefill state == one short_conv over everything; an fp32 state stays fp32.
    N, C, W, T = 3, 8, 4, 6
    x, weight = torch.randn(T, N, C, dtype=torch.bfloat16), torch.randn(C, W)
    state0 = torch.randn(N, C, W - 1).bfloat16().float()  # bf16-representable, so no rounding on entry
    state = state0
    steps = []
    for t in range(T):
        y, state = short_conv_step(x[t], weight, state)
        steps.append(y)
    assert state.dtype == torch.float32 and steps[0].dtype == torch.bfloat16
    cu_seqlens = torch.arange(0, N * T + 1, T)
    y_ref, state_ref = short_conv(x.transpose(0, 1).reshape(N * T, C), weight, state0, cu_seqlens)
    torch.testing.assert_close(torch.stack(steps, 1).reshape(N * T, C), y_ref, rtol=0, atol=0)
    torch.testing.assert_close(state, state_ref.float(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_short_conv_step_cuda_graph():
    N, C, W = 8, 64, 4

    def inputs():
        return torch.randn(N, C, device="cuda", dtype=torch.bfloat16), torch.randn(N, C, W - 1, device="cuda")

    weight = torch.randn(C, W, device="cuda")
    x, state0 = inputs()
    y, state = short_conv_step(x, weight, state0)
    y_ref, state_ref = short_conv(x, weight, state0, torch.arange(N + 1, device="cuda"))
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(y, y_ref)  # bf16 tolerance: CUDA may sum the window in another order
    torch.testing.assert_close(state, state_ref.float(), rtol=0, atol=0)
    assert_replay_matches_eager(lambda x, s: short_conv_step(x, weight, s), inputs(), inputs())
