"""KDA decode on the state slots themselves: the Triton conv-window step and fla-core's in-place recurrence
equal the gather / step / scatter references; slots not in the batch are untouched. The Triton kernels run
in Triton's interpreter on CPU (tests/conftest.py switches it on)."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.kda import naive

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("planes", [1, 3])
@pytest.mark.parametrize("W,C", [(4, 48), (2, 300), (4, 513), (3, 96)])  # W=3: taps not a power of two
@pytest.mark.parametrize("extra", [0, 8], ids=["contiguous", "strided"])  # rows C + 8 apart: a column slice
def test_conv_step_inplace_kernel(W, C, planes, extra):
    from kestrel.ops.kda.triton_conv import conv_step_inplace

    g = torch.Generator().manual_seed(W + C)
    N, S = 3, 7
    x = torch.randn(N, C + extra, generator=g).to(DEVICE)[:, :C]
    weight = torch.randn(C, W, generator=g).to(DEVICE)
    pool = torch.randn(S, C, W - 1, generator=g).to(DEVICE)
    slots = torch.tensor([5, 0, 2], device=DEVICE)
    ref_pool = pool.clone()
    ref = naive.conv_step_inplace(x, weight, ref_pool, slots, planes)
    got = conv_step_inplace(x, weight, pool, slots, planes, block=128)
    assert got.shape == ref.shape == ((N, C) if planes == 1 else (planes, N, C // planes))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert all(t.is_contiguous() for t in (got if planes > 1 else [got]))  # q, k, v read without copies
    assert torch.equal(pool, ref_pool)  # the windows advanced exactly like the reference's, others untouched


def test_fla_recurrent_inplace_matches_reference():
    fla = pytest.importorskip("kestrel.ops.kda.fla")
    g = torch.Generator().manual_seed(0)
    N, H, K, S = 3, 2, 16, 6
    qkv = torch.randn(N, 3 * H * K, generator=g).to(DEVICE)  # split views are not contiguous, as in the layer
    q, k, v = (t.reshape(N, 1, H, K) for t in qkv.split(H * K, dim=-1))
    gate = -torch.rand(N, 1, H, K, generator=g).to(DEVICE)
    beta = torch.rand(N, 1, H, generator=g).to(DEVICE)
    pool = torch.randn(S, H, K, K, generator=g).to(DEVICE)
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    ref_pool = pool.clone()
    ref = naive.recurrent_inplace(q, k, v, gate, beta, ref_pool, slots, use_qk_l2norm=True)
    got = fla.recurrent_inplace(q, k, v, gate, beta, pool, slots, use_qk_l2norm=True)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool, ref_pool, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool[[0, 3, 5]], ref_pool[[0, 3, 5]])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fla_recurrent_inplace_makes_the_gate_and_beta_in_the_kernel(lower_bound):
    """Decode hands fla's kernel the raw forget projection and beta's logits (gate=..., beta_logits=True): the
    same result as the decay from `kda_gate` and beta's sigmoid computed first."""
    fla = pytest.importorskip("kestrel.ops.kda.fla")
    g = torch.Generator().manual_seed(1)
    N, H, K, S = 3, 2, 16, 6
    q, k, v = (torch.randn(N, 1, H, K, generator=g).to(DEVICE) for _ in range(3))
    f = torch.randn(N, 1, H, K, generator=g).to(DEVICE)  # the raw forget projection
    b = torch.randn(N, 1, H, generator=g).to(DEVICE)  # beta's logits
    A_log = torch.rand(H, generator=g).mul(2).to(DEVICE)
    dt_bias = torch.randn(H * K, generator=g).to(DEVICE)
    pool = torch.randn(S, H, K, K, generator=g).to(DEVICE)
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    ref_pool, naive_pool = pool.clone(), pool.clone()
    gate = naive.kda_gate(f, A_log, dt_bias, lower_bound)
    ref = naive.recurrent_inplace(q, k, v, gate, torch.sigmoid(b), ref_pool, slots, use_qk_l2norm=True)
    params = dict(use_qk_l2norm=True, gate=(A_log, dt_bias, lower_bound), beta_logits=True)
    got_naive = naive.recurrent_inplace(q, k, v, f, b, naive_pool, slots, **params)
    got = fla.recurrent_inplace(q, k, v, f, b, pool, slots, **params)
    assert torch.equal(got_naive, ref) and torch.equal(naive_pool, ref_pool)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool, ref_pool, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lower_bound", [None, -5.0, "no gate"])
@pytest.mark.parametrize(
    "K,V,block_v", [(16, 16, 16), (16, 40, 16), (24, 20, 32)]
)  # partial tiles, K not 2^n
def test_triton_recurrent_inplace_matches_reference(K, V, block_v, lower_bound):
    """Our Triton decode step: the raw forget projection and beta's logits made the decay and beta inside (or a
    ready decay with no gate), l2-normalized q and k from strided views (no copies), the states advanced in their
    slots and every other slot untouched; a negative slot reads and writes nothing and gives zeros."""
    from kestrel.ops.kda.triton_recurrent import recurrent_inplace

    g = torch.Generator().manual_seed(K + V)
    N, H, S = 4, 3, 7
    qkf = torch.randn(N, 3 * H * K + H, generator=g).to(DEVICE)  # split views, as in the layer's in_proj
    q, k, f = (t.reshape(N, 1, H, K) for t in qkf[:, : 3 * H * K].split(H * K, dim=-1))
    b = qkf[:, 3 * H * K :].reshape(N, 1, H)  # beta's logits, a strided column slice
    v = torch.randn(N, 1, H, V, generator=g).to(DEVICE)
    A_log = torch.rand(H, generator=g).mul(2).to(DEVICE)
    dt_bias = torch.randn(H * K, generator=g).to(DEVICE)
    big = torch.randn(S + 1, H, K, V, generator=g).to(DEVICE)
    pool = big[1:]  # slot -1 would address big[0]: it must stay as it is
    before = big[0].clone()
    slots = torch.tensor([4, 1, -1, 2], device=DEVICE)
    live = torch.tensor([0, 1, 3], device=DEVICE)
    ref_pool = pool.clone()
    if lower_bound == "no gate":
        f = -torch.rand(N, 1, H, K, generator=g).to(DEVICE)  # a ready decay
        params = dict(scale=0.3)
        ref_params = dict(scale=0.3)
    else:
        params = dict(use_qk_l2norm=True, gate=(A_log, dt_bias, lower_bound), beta_logits=True)
        ref_params = params
    ref = naive.recurrent_inplace(
        q[live], k[live], v[live], f[live], b[live], ref_pool, slots[live], **ref_params
    )
    got = recurrent_inplace(q, k, v, f, b, pool, slots, block_v=block_v, **params)
    assert got.shape == (N, 1, H, V) and got.dtype == v.dtype
    assert torch.allclose(got[live], ref, atol=1e-5, rtol=1e-5)
    assert (got[2] == 0).all() and torch.equal(big[0], before)  # the negative slot: o = 0, nothing written
    assert torch.allclose(pool, ref_pool, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[0, 3, 5, 6]], ref_pool[[0, 3, 5, 6]])  # slots not in the batch: untouched


def test_triton_recurrent_inplace_in_bf16_as_the_layer_calls_it():
    """bf16 activations, Kimi-Linear's [1, 1, H, 1] A_log, forget projections past softplus's threshold (20),
    the default block_v for a batch of 16+ sequences: the reference's result and states."""
    from kestrel.ops.kda.triton_recurrent import choose_block_v, recurrent_inplace

    g = torch.Generator().manual_seed(9)
    N, H, K, V, S = 17, 2, 16, 80, 20
    assert choose_block_v(N, V) == 64  # two value blocks, the second partial
    q, k = (torch.randn(N, 1, H, K, generator=g).bfloat16().to(DEVICE) for _ in range(2))
    v = torch.randn(N, 1, H, V, generator=g).bfloat16().to(DEVICE)
    f = (torch.randn(N, 1, H, K, generator=g) * 15).bfloat16().to(DEVICE)  # some past 20: softplus(x) = x
    b = torch.randn(N, 1, H, generator=g).bfloat16().to(DEVICE)
    A_log = torch.rand(1, 1, H, 1, generator=g).to(DEVICE)
    dt_bias = torch.randn(H * K, generator=g).to(DEVICE)
    pool = torch.randn(S, H, K, V, generator=g).to(DEVICE)
    slots = torch.randperm(S, generator=g)[:N].to(DEVICE)
    ref_pool = pool.clone()
    params = dict(use_qk_l2norm=True, gate=(A_log, dt_bias, None), beta_logits=True)
    ref = naive.recurrent_inplace(q, k, v, f, b, ref_pool, slots, **params)
    got = recurrent_inplace(q, k, v, f, b, pool, slots, **params)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(pool, ref_pool, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K,K_f,V", [(16, 16, 16), (24, 20, 40)])  # partial tiles: K, K_f not 2^n
def test_triton_recurrent_inplace_projects_the_forget_gate_itself(K, K_f, V, dtype):
    """With f_b, g is f_a and each program makes its head's raw forget projection f_a f_b^T (what the layer does
    for a few sequences, `F_B_MAX_ROWS`): the reference, which projects first, and the kernel given the projection
    made outside (the GEMV's rounding: bf16 to bf16, so the same decay)."""
    from kestrel.ops.kda.triton_recurrent import recurrent_inplace

    g = torch.Generator().manual_seed(K + K_f + V)
    N, H, S = 3, 2, 5
    q, k = (torch.randn(N, 1, H, K, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    v = torch.randn(N, 1, H, V, generator=g).to(dtype).to(DEVICE)
    f_a = torch.randn(N, 1, K_f, generator=g).to(dtype).to(DEVICE)
    f_b = (torch.randn(H * K, K_f, generator=g) * 3).to(dtype).to(DEVICE)  # some past softplus's threshold
    b = torch.randn(N, 1, H, generator=g).to(dtype).to(DEVICE)
    A_log = torch.rand(H, generator=g).to(DEVICE)
    dt_bias = torch.randn(H * K, generator=g).to(DEVICE)
    pool = torch.randn(S, H, K, V, generator=g).to(DEVICE)
    slots = torch.tensor([3, 0, 4], device=DEVICE)
    params = dict(use_qk_l2norm=True, gate=(A_log, dt_bias, None), beta_logits=True)
    pools = [pool.clone() for _ in range(3)]
    ref = naive.recurrent_inplace(q, k, v, f_a, b, pools[0], slots, f_b=f_b, **params)
    got = recurrent_inplace(q, k, v, f_a, b, pools[1], slots, f_b=f_b, **params)
    f = torch.nn.functional.linear(f_a, f_b).view(N, 1, H, K)
    apart = recurrent_inplace(q, k, v, f, b, pools[2], slots, **params)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert got.shape == (N, 1, H, V) and got.dtype == dtype
    assert torch.allclose(got.float(), ref.float(), **tol) and torch.allclose(
        got.float(), apart.float(), **tol
    )
    assert torch.allclose(pools[1], pools[0], **tol) and torch.allclose(pools[1], pools[2], **tol)
    assert torch.equal(pools[1][[1, 2]], pool[[1, 2]])  # slots not in the batch: untouched
    with pytest.raises(AssertionError, match="f_a"):
        recurrent_inplace(q, k, v, f, b, pools[1], slots, f_b=f_b, **params)


@pytest.mark.parametrize("choice", ["triton", "fla"])
def test_the_fla_backend_decodes_with_our_step_unless_asked(monkeypatch, choice):
    """KESTREL_KDA_DECODE: the fla backend's decode step on the slots is ours by default, fla-core's on request."""
    pytest.importorskip("kestrel.ops.kda.fla")
    from kestrel.ops.kda import fla, get_kda_backend, triton_recurrent

    monkeypatch.setenv("KESTREL_KDA_BACKEND", "fla")
    monkeypatch.setenv("KESTREL_KDA_DECODE", choice)
    want = {"triton": triton_recurrent.recurrent_inplace, "fla": fla.recurrent_inplace}[choice]
    assert get_kda_backend(torch.device(DEVICE)).recurrent_inplace is want
