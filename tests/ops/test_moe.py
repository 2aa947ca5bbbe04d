"""MoE router, experts, dense GLU MLP and latent MoE against transformers and plain loops."""

from __future__ import annotations

import pytest
import torch

from kestrel.ops.moe import glu_mlp, latent_moe, moe_experts, moe_experts_grouped, route
from kestrel.ops.moe.grouped import _use_grouped_mm
from tests.ops.graph_check import assert_replay_matches_eager


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def _kimi_config(num_experts: int, top_k: int, n_group: int, topk_group: int, hidden: int, inter: int = 8):
    kimi = pytest.importorskip("transformers.models.kimi_linear.configuration_kimi_linear")
    return kimi.KimiLinearConfig(
        vocab_size=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_expert_group=n_group,
        topk_group=topk_group,
        moe_renormalize=True,
        routed_scaling_factor=2.446,
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_act="silu",
    )


ROUTER_CASES = [  # (experts, top_k, groups, kept groups)
    (16, 4, 1, 1),
    (8, 3, 4, 2),
    (12, 4, 3, 2),
]


@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group", ROUTER_CASES)
def test_route_matches_kimi_linear_router(num_experts, top_k, n_group, topk_group):
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    torch.manual_seed(0)
    hidden = 24
    cfg = _kimi_config(num_experts, top_k, n_group, topk_group, hidden)
    router = modeling.KimiLinearTopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.copy_(0.3 * torch.randn(num_experts))
    x = torch.randn(37, hidden)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    w, ids = route(
        logits, router.e_score_correction_bias, top_k, True, cfg.routed_scaling_factor, n_group, topk_group
    )
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (37, top_k)
    ref_w, ref_ids = _sorted_by_id(ref_w, ref_ids)
    w, ids = _sorted_by_id(w, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    if n_group > 1:  # every selected expert lies in one of the kept groups
        groups_used = ids // (num_experts // n_group)  # [T, A]
        assert all(len(set(row.tolist())) <= topk_group for row in groups_used)


def test_route_matches_deepseek_v3_router():
    ds_cfg = pytest.importorskip("transformers.models.deepseek_v3.configuration_deepseek_v3")
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    torch.manual_seed(1)
    cfg = ds_cfg.DeepseekV3Config(
        vocab_size=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    router = ds.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    x = torch.randn(29, 16)
    with torch.no_grad():
        out = router(x)
    logits, ref_w, ref_ids = out
    w, ids = route(logits, router.e_score_correction_bias, 4, True, 2.5, 4, 2)
    ref_w, ref_ids = _sorted_by_id(ref_w, ref_ids)
    w, ids = _sorted_by_id(w, ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)


def test_route_formula_and_order():
    torch.manual_seed(2)
    logits = torch.randn(11, 10, dtype=torch.bfloat16)
    w, ids = route(logits, None, 3, False, 1.7)
    s = torch.sigmoid(logits.float())
    top = s.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(ids, top.indices[:, :3])
    torch.testing.assert_close(w, 1.7 * top.values[:, :3], rtol=0, atol=0)
    w_norm, ids_norm = route(logits, None, 3, True, 1.0)
    assert torch.equal(ids_norm, ids)
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(11), rtol=1e-6, atol=1e-6)
    assert (w_norm[:, :-1] >= w_norm[:, 1:]).all()  # best first


def test_correction_bias_selects_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w0, ids0 = route(logits, None, 2, False, 1.0)
    assert ids0.tolist() == [[0, 1]]
    w, ids = route(logits, bias, 2, False, 1.0)
    assert ids.tolist() == [[3, 0]]  # the bias pulls expert 3 in first ...
    s = torch.sigmoid(logits)[0]
    torch.testing.assert_close(w[0], torch.stack([s[3], s[0]]), rtol=0, atol=0)  # ... but weighs it unbiased
    wn, _ = route(logits, bias, 2, True, 2.0)
    torch.testing.assert_close(wn[0], 2.0 * torch.stack([s[3], s[0]]) / (s[3] + s[0]), rtol=1e-6, atol=0)


def test_route_ties_pick_lower_expert_ids():
    logits = torch.zeros(3, 8)
    logits[1, 5] = 1.0
    _, ids = route(logits, None, 3, True, 1.0)
    assert ids.tolist() == [[0, 1, 2], [5, 0, 1], [0, 1, 2]]
    # equal groups: the lower group wins, then lower ids inside it
    _, ids = route(torch.zeros(1, 8), None, 2, True, 1.0, num_groups=4, topk_groups=1)
    assert ids.tolist() == [[0, 1]]
    # a bias that ties two experts after shifting
    _, ids = route(torch.tensor([[0.0, 0.0, 0.0, 0.0]]), torch.tensor([0.0, 0.1, 0.0, 0.1]), 2, True, 1.0)
    assert ids.tolist() == [[1, 3]]


def test_route_group_limit_excludes_other_groups():
    # group 0 = {0,1}, group 1 = {2,3}: expert 2 has the single best score but group 0 has the best top-2 sum
    logits = torch.tensor([[1.0, 1.0, 3.0, -3.0]])
    _, ids_free = route(logits, None, 2, False, 1.0)
    _, ids_grouped = route(logits, None, 2, False, 1.0, num_groups=2, topk_groups=1)
    assert ids_free.tolist() == [[2, 0]]
    assert ids_grouped.tolist() == [[0, 1]]


def test_every_group_kept_is_plain_top_k_and_the_layer_routes_it_so():
    """topk_group == num_expert_group masks no group: the same experts and weights as plain top-k, so the layer
    takes it as plain (the fused routers, which know no groups, then apply)."""
    import dataclasses

    from kestrel.layers.moe import MoE
    from kestrel.presets import preset_config

    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(64, 32, generator=g), 0.1 * torch.randn(32, generator=g)
    plain = route(logits, bias, 6, True, 2.5)
    for groups in (2, 4, 8):
        kept = route(logits, bias, 6, True, 2.5, num_groups=groups, topk_groups=groups)
        assert all(torch.equal(a, b) for a, b in zip(plain, kept))
    config = preset_config("tiny")
    layer = MoE(dataclasses.replace(config, num_expert_group=2, topk_group=2), 1)
    assert (layer.groups, layer.topk_groups) == (1, 1)
    layer = MoE(dataclasses.replace(config, num_expert_group=2, topk_group=1), 1)
    assert (layer.groups, layer.topk_groups) == (2, 1)


def _act(gate_up, act, beta=4.0, linear_beta=25.0):
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return gate * torch.sigmoid(gate) * up
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * linear_beta * torch.tanh(up / linear_beta)


def _loop_experts(x, w13, w2, weights, ids, act):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for a in range(ids.shape[1]):
            e = ids[t, a]
            out[t] += weights[t, a] * (w2[e] @ _act(w13[e] @ x[t], act))
    return out


def _random_moe(T=13, D=20, I=6, E=7, A=3, seed=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    w13 = torch.randn(E, 2 * I, D, generator=g, dtype=dtype) / D**0.5
    w2 = torch.randn(E, D, I, generator=g, dtype=dtype) / I**0.5
    weights, ids = route(torch.randn(T, E, generator=g), None, A, True, 2.0)
    return x, w13, w2, weights.to(dtype), ids


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_moe_experts_matches_loop_fp64(act):
    x, w13, w2, weights, ids = _random_moe()
    out = moe_experts(x, w13, w2, weights, ids, act)
    ref = _loop_experts(x, w13, w2, weights, ids, act)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)  # fp32 activation and accumulation


def test_moe_experts_bf16_close_to_fp64():
    x, w13, w2, weights, ids = _random_moe(seed=4)
    ref = _loop_experts(x, w13, w2, weights, ids, "silu")
    out = moe_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights.float(), ids, "silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


def test_moe_experts_unused_experts_and_repeated_tokens():
    x, w13, w2, _, _ = _random_moe(T=4, E=5, A=2, seed=5)
    ids = torch.tensor([[4, 2], [2, 4], [4, 2], [2, 4]])  # experts 0, 1, 3 get nothing
    weights = torch.rand(4, 2, dtype=x.dtype)
    torch.testing.assert_close(
        moe_experts(x, w13, w2, weights, ids, "silu"), _loop_experts(x, w13, w2, weights, ids, "silu")
    )


def test_moe_experts_matches_kimi_linear_experts():
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    cfg = _kimi_config(num_experts=7, top_k=3, n_group=1, topk_group=1, hidden=20, inter=6)
    cfg._experts_implementation = "eager"  # the plain per-expert loop, not a dispatched kernel
    experts = modeling.KimiLinearExperts(cfg)
    x, w13, w2, weights, ids = _random_moe(dtype=torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)  # same layout: [E, 2I, D], gate rows first
        experts.down_proj.copy_(w2)  # [E, D, I]
        ref = experts(x, ids, weights)
    out = moe_experts(x, w13, w2, weights, ids, "silu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # layout check: swapping the gate and up halves must change the result
    I = w13.shape[1] // 2
    swapped = torch.cat((w13[:, I:], w13[:, :I]), dim=1)
    assert not torch.allclose(moe_experts(x, swapped, w2, weights, ids, "silu"), ref, atol=1e-3)


def test_situ_differs_from_silu():
    x, w13, w2, weights, ids = _random_moe(seed=6)
    x = 4 * x  # large enough that the soft caps bite
    silu = moe_experts(x, w13, w2, weights, ids, "silu")
    situ = moe_experts(x, w13, w2, weights, ids, "situ")
    assert torch.isfinite(situ).all()
    assert (silu - situ).abs().max() > 1e-2
    # with huge betas SiTU reduces to SwiGLU
    wide = moe_experts(x, w13, w2, weights, ids, "situ", situ_beta=1e6, situ_linear_beta=1e6)
    torch.testing.assert_close(wide, silu, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        moe_experts(x, w13, w2, weights, ids, "gelu")


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_glu_mlp_matches_formula(act):
    g = torch.Generator().manual_seed(7)
    D, I = 12, 10
    x = torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    w13 = torch.randn(2 * I, D, generator=g, dtype=torch.float64)
    w2 = torch.randn(D, I, generator=g, dtype=torch.float64)
    h = _act(torch.cat((x @ w13[:I].T, x @ w13[I:].T), dim=-1), act)
    torch.testing.assert_close(glu_mlp(x, w13, w2, act), h @ w2.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_norm", [True, False])
def test_latent_moe_matches_formula(use_norm):
    g = torch.Generator().manual_seed(8)
    T, D, Lat, I, E, A = 9, 24, 16, 6, 5, 2
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    down = torch.randn(Lat, D, generator=g, dtype=torch.float64) / D**0.5
    up = torch.randn(D, Lat, generator=g, dtype=torch.float64) / Lat**0.5
    norm_w = 1 + 0.1 * torch.randn(Lat, generator=g, dtype=torch.float64) if use_norm else None
    w13 = torch.randn(E, 2 * I, Lat, generator=g, dtype=torch.float64) / Lat**0.5
    w2 = torch.randn(E, Lat, I, generator=g, dtype=torch.float64) / I**0.5
    router_w = torch.randn(E, D, generator=g, dtype=torch.float64)
    weights, ids = route(x @ router_w.T, None, A, True, 1.5)  # the router sees the full-width x
    out = latent_moe(x, down, up, norm_w, 1e-5, w13, w2, weights.double(), ids, "situ")

    ref = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        z = down @ x[t]
        s = sum(weights[t, a].double() * (w2[ids[t, a]] @ _act(w13[ids[t, a]] @ z, "situ")) for a in range(A))
        if use_norm:
            s = norm_w * s / torch.sqrt(s.pow(2).mean() + 1e-5)
        ref[t] = up @ s
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- grouped (host-sync-free) experts

GROUPED_CASES = {  # (T, E, A)
    "prefill": (13, 7, 3),
    "one_token": (1, 5, 2),
    "top1": (6, 4, 1),
}


def _grouped_paths():
    """The fallback always; torch._grouped_mm forced on too where this torch runs it on CPU."""
    paths = [False]
    if hasattr(torch, "_grouped_mm"):
        try:
            torch._grouped_mm(
                torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32)
            )
            paths.append(True)
        except (RuntimeError, NotImplementedError):
            pass
    return paths


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
@pytest.mark.parametrize("case", list(GROUPED_CASES))
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_grouped_equals_naive_fp32(act, case, use_grouped_mm):
    T, E, A = GROUPED_CASES[case]
    x, w13, w2, weights, ids = _random_moe(T=T, D=16, I=8, E=E, A=A, seed=9, dtype=torch.float32)
    ref = moe_experts(x, w13, w2, weights, ids, act)
    out = moe_experts_grouped(x, w13, w2, weights, ids, act, use_grouped_mm=use_grouped_mm)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
def test_grouped_unused_experts_and_bf16(use_grouped_mm):
    x, w13, w2, _, _ = _random_moe(T=4, D=16, I=8, E=6, A=2, seed=10)
    ids = torch.tensor([[4, 2], [2, 4], [4, 2], [5, 4]])  # experts 0, 1, 3 get nothing; the last one row
    weights = torch.rand(4, 2, dtype=torch.float32)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    ref = moe_experts(x, w13, w2, weights, ids, "situ")
    out = moe_experts_grouped(x, w13, w2, weights, ids, "situ", use_grouped_mm=use_grouped_mm)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
def test_grouped_no_tokens_and_gradients(use_grouped_mm):
    """No tokens gives an empty result; the gradients equal the reference loop's (training uses this path
    where torch._grouped_mm has a backward)."""
    x, w13, w2, weights, ids = _random_moe(T=0, D=16, I=8, E=4, A=2, seed=11, dtype=torch.float32)
    assert moe_experts_grouped(x, w13, w2, weights, ids, "silu", use_grouped_mm=use_grouped_mm).shape == (
        0,
        16,
    )
    x, w13, w2, weights, ids = _random_moe(T=5, D=16, I=8, E=4, A=2, seed=12, dtype=torch.float32)
    inputs = [t.requires_grad_() for t in (x, w13, w2, weights)]
    ref = torch.autograd.grad(moe_experts(*inputs, ids, "silu").square().sum(), inputs)
    got = moe_experts_grouped(*inputs, ids, "silu", use_grouped_mm=use_grouped_mm)
    for r, g in zip(ref, torch.autograd.grad(got.square().sum(), inputs)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def _cuda_moe(T, seed):
    x, w13, w2, weights, ids = _random_moe(T=T, D=64, I=32, E=8, A=2, seed=seed, dtype=torch.float32)
    return x.cuda().bfloat16(), w13.cuda().bfloat16(), w2.cuda().bfloat16(), weights.cuda(), ids.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_path_matches_naive_on_cuda():
    x, w13, w2, weights, ids = _cuda_moe(T=37, seed=11)
    assert _use_grouped_mm(x, w2)
    for act in ("silu", "situ"):
        out = moe_experts_grouped(x, w13, w2, weights, ids, act)
        ref = moe_experts(x, w13, w2, weights, ids, act)
        assert out.dtype == torch.bfloat16
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_cuda_graph(use_grouped_mm):
    x, w13, w2, weights, ids = _cuda_moe(T=8, seed=12)
    _, _, _, fresh_weights, fresh_ids = _cuda_moe(T=8, seed=13)  # other routing after capture

    def step(x, weights, ids):
        return moe_experts_grouped(x, w13, w2, weights, ids, "silu", use_grouped_mm=use_grouped_mm)

    assert_replay_matches_eager(step, (x, weights, ids), (torch.randn_like(x), fresh_weights, fresh_ids))


def test_router_logits_stay_fp32_under_autocast():
    """Training runs under bf16 autocast; the router's logits are the fp32 product there as at inference, so a
    token picks the same experts in training and in serving."""
    from kestrel.layers.moe import Router
    from kestrel.presets import preset_config

    router = Router(preset_config("tiny"))
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, router.weight.shape[1], generator=torch.Generator().manual_seed(1))
    expected = x @ router.weight.t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router(x)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- training's moves between pairs and rows


def _pairs_and_rows(T, A, E, D, seed, dtype):
    """ids [T, A] with repeated experts and ids outside [0, E) (-1 and E: other ranks' experts), the expert-major
    order [M] and its inverse [M], weights [T, A] fp32 and expert rows y [M, D]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E + 1, (T, A), generator=g)
    if T:
        ids[0] = 1  # one expert in every slot of a token
        ids[-1, 0] = -1
        ids[T // 2, -1] = E
    order = torch.argsort(ids.reshape(-1), stable=True)
    inv = torch.argsort(order)
    weights = torch.rand(T, A, generator=g)
    y = torch.randn(T * A, D, generator=g).to(dtype)
    return ids, order, inv, weights, y


def _offs(ids, order, E):
    """The groups' cumulative ends [E] int32 of the expert-major rows (ids outside [0, E) past offs[-1])."""
    return torch.searchsorted(ids.reshape(-1)[order], torch.arange(E), right=True).to(torch.int32)


def _combine_by_scatter(y, order, weights, ids, E):
    """The combine as first written, in fp64: each expert-major row weighted, then added into its token's row."""
    T, A = ids.shape
    flat = ids.reshape(-1)
    in_range = ((flat >= 0) & (flat < E))[order, None]  # [M, 1]
    rows = torch.where(in_range, y.double() * weights.reshape(-1)[order, None].double(), 0.0)  # [M, D]
    return torch.zeros(T, y.shape[1], dtype=torch.float64).index_add_(0, order // A, rows)


PAIR_CASES = [(0, 2), (1, 1), (5, 1), (9, 3)]  # (T, A)


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,A", PAIR_CASES)
def test_gather_up_equals_autograd_through_the_gathered_rows(T, A, dtype, use_grouped_mm):
    """Training's gather of each (token, slot) pair's row and its experts' up-projection, which keeps x instead of
    the gathered rows for its backward: the values and the gradients of x (each token's A rows summed, gathered
    by the inverse order) and of the weights (the rows gathered again) that autograd gives through
    x[order // A] and the grouped linear; experts with no rows included."""
    from kestrel.ops.moe.grouped import _GatherUp, _grouped_linear

    if use_grouped_mm and dtype == torch.float64:
        pytest.skip("torch._grouped_mm takes no fp64")
    E, D, N = 5, 16, 8
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(1, E, (T, A), generator=g)  # expert 0 gets nothing
    order = torch.argsort(ids.reshape(-1), stable=True)
    inv = torch.argsort(order)
    offs = _offs(ids, order, E)
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    w = torch.randn(E, N, D, generator=g).requires_grad_()  # fp32 master weights, cast to x's dtype inside
    up = torch.randn(T * A, N, generator=g).to(dtype)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    got = _GatherUp.apply(x, w, order, inv, offs, torch.ones(T, A, dtype=torch.bool), use_grouped_mm)
    want = _grouped_linear(x2[order // A], w2, offs, use_grouped_mm)
    assert got.dtype == dtype and torch.equal(got, want)
    got.backward(up)
    want.backward(up)
    assert x.grad.dtype == dtype and w.grad.dtype == torch.float32
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(x.grad, x2.grad, **tol)
    torch.testing.assert_close(w.grad, w2.grad, **tol)


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
def test_training_keeps_no_rows_of_the_experts_width_for_the_backward(use_grouped_mm):
    """The grouped experts in training keep x [T, D] for the up-projection's backward, not the [T * A, D] rows
    gathered from it (A copies of x), and their rows h [T * A, I] for the down-projection's and the combine's,
    not the down-projection's output y [T * A, D] (on `mini` at 4 rows each is 20 GB a step); nor copies of the
    weights in x's dtype: what autograd keeps is hooked and measured."""
    T, A, E, D, I = 12, 4, 5, 24, 8  # D != 2I: gate_up [T * A, 2I] is not y's shape
    x, w13, w2, weights, ids = _random_moe(T=T, D=D, I=I, E=E, A=A, seed=20, dtype=torch.float32)
    x = x.bfloat16().requires_grad_()
    w13, w2, weights = w13.requires_grad_(), w2.requires_grad_(), weights.requires_grad_()
    kept = []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = moe_experts_grouped(x, w13, w2, weights, ids, "silu", use_grouped_mm=use_grouped_mm)
    assert not [k for k in kept if k[0] == (T * A, D)], kept  # neither x's gathered rows nor y
    assert ((E, 2 * I, D), torch.bfloat16) not in kept, kept  # w13 in x's dtype
    assert ((E, D, I), torch.bfloat16) not in kept, kept  # w2 in x's dtype
    assert ((T, D), torch.bfloat16) in kept and ((T * A, I), torch.bfloat16) in kept  # x and h
    out.float().sum().backward()
    for p in (x, w13, w2, weights):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)


def _down_by_pair(h, w2, order, ids):
    """The experts' down-projection row by row, in h's dtype: row r (pair order[r]) times its expert's w2 (ids
    outside [0, E) clamped into it: the combine drops their rows)."""
    e = ids.reshape(-1)[order].clamp(0, w2.shape[0] - 1)  # [M]
    return torch.einsum("mi,mdi->md", h, w2[e])


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,A", PAIR_CASES)
def test_combine_down_equals_the_scatter_form(T, A, dtype, use_grouped_mm, monkeypatch):
    """The experts' down-projection and the combine (fp32 by definition), and their gradients for h, w2 and the
    weights, against the row-by-row product and the weighted index_add_ in fp64 through autograd, also for its
    plain-autograd reference: the weights' gradient taken as <grad[t] w2, h[p]> equals <grad[t], y[p]>; ids
    outside [0, E) (-1 and E) add nothing and get no gradient, also where their rows hold NaN (as h's rows of
    those pairs, and as every product's rows past offs[-1], which torch._grouped_mm may leave unwritten)."""
    _check_combine_down(T, A, dtype, use_grouped_mm, seed=15)
    _check_combine_down(T, A, dtype, use_grouped_mm, seed=15, poison=monkeypatch)


def _leave_rows_past_the_groups_nan(monkeypatch):
    """Every grouped product's rows past offs[-1] NaN from here on, as torch._grouped_mm may leave them unwritten."""
    from kestrel.ops.moe import grouped

    linear = grouped._grouped_linear

    def unwritten(a, w, offs, grouped_mm):
        out = linear(a, w, offs, grouped_mm)
        return out.index_fill(0, torch.arange(int(offs[-1]), out.shape[0]), float("nan"))

    monkeypatch.setattr(grouped, "_grouped_linear", unwritten)


def _check_combine_down(T, A, dtype, use_grouped_mm, seed, poison=None):
    from kestrel.ops.moe import grouped

    E, D, I = 4, 16, 8
    ids, order, inv, weights, _ = _pairs_and_rows(T, A, E, D, seed=seed, dtype=dtype)
    offs = _offs(ids, order, E)
    in_range = (ids >= 0) & (ids < E)  # [T, A]
    foreign = ~in_range.reshape(-1)[order]  # [M]
    g = torch.Generator().manual_seed(seed + 1)
    h = torch.randn(T * A, I, generator=g).to(dtype)
    w2 = torch.randn(E, D, I, generator=g).to(dtype).float()  # fp32 master weights holding h's dtype's values
    up = torch.randn(T, D, generator=g)
    h_ref, w2_ref, w_ref = (t.double().requires_grad_() for t in (h, w2, weights))
    y_ref = _down_by_pair(h_ref, w2_ref, order, ids)  # [M, D]
    ref = _combine_by_scatter(y_ref, order, w_ref, ids, E)
    ref.backward(up.double())
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: 1% by norm (products of rounded rows)
    # the weights' gradient is a dot a pair, <grad[t], y[p]>: bounded entry by entry by |grad[t]| |y[p]| times the
    # rounding (a short dot's cancellation can leave its value with a larger relative error)
    bound = rel * up.double().norm(dim=-1)[:, None] * y_ref.detach()[inv].view(T, A, D).norm(dim=-1) + 1e-6

    def close(got, want):
        got, want = got.detach().double(), want.detach()
        assert float((got - want).norm()) <= rel * float(want.norm()) + 1e-6, (got, want)

    if poison is not None:
        h = h.masked_fill(foreign[:, None], float("nan"))
        _leave_rows_past_the_groups_nan(poison)
    # the reference through torch._grouped_mm's own backward leaves h's rows past offs[-1] (ids >= E) unwritten
    plain = poison is None and not use_grouped_mm
    for op in (grouped.combine_down, grouped.combine_down.eager) if plain else (grouped.combine_down,):
        hh, ww2, w = (t.clone().requires_grad_() for t in (h, w2, weights))
        out = op(hh, ww2, offs, order, inv, w, in_range, use_grouped_mm)
        assert out.dtype == torch.float32 and out.shape == (T, D)
        close(out, ref)
        out.backward(up)
        assert hh.grad.dtype == dtype and ww2.grad.dtype == torch.float32
        close(hh.grad, h_ref.grad)
        close(ww2.grad, w2_ref.grad)
        assert bool(((w.grad.double() - w_ref.grad).abs() <= bound).all()), (w.grad, w_ref.grad)
        assert not hh.grad[foreign].any()
    with torch.no_grad():  # inference: the product and the sum alone
        got = grouped.combine_down(h, w2, offs, order, inv, weights, in_range, use_grouped_mm)
    torch.testing.assert_close(got, out)


@pytest.mark.parametrize("use_grouped_mm", _grouped_paths())
def test_training_gradients_ignore_rows_no_expert_wrote(use_grouped_mm, monkeypatch):
    """Ids outside [0, E) (another rank's experts) add nothing in training's gradients either: with every grouped
    product's rows past offs[-1] NaN (torch._grouped_mm may leave them unwritten), the gradients of x, the
    weights and the routing weights are finite and those of the run without NaN."""
    from kestrel.ops.moe import grouped

    x, w13, w2, weights, _ = _random_moe(T=6, D=16, I=8, E=4, A=2, seed=21, dtype=torch.float32)
    ids = torch.tensor([[0, 3], [4, 1], [2, -1], [1, 2], [4, 0], [3, 2]])  # 4 = E and -1: not these experts

    def grads():
        given = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
        out = grouped.moe_experts_grouped(*given, ids, "silu", use_grouped_mm=use_grouped_mm)
        out.square().sum().backward()
        return [t.grad for t in given]

    want = grads()
    _leave_rows_past_the_groups_nan(monkeypatch)
    for got, ref in zip(grads(), want):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, ref)


def test_pair_moves_compiled_equal_eager(monkeypatch):
    """KESTREL_COMPILE_TRAIN=on compiles the pair gather's backward and the combine's sum and gradients (on the CPU
    too; auto: on CUDA): the eager values and gradients, bf16 rows as in training."""
    from torch._dynamo.utils import counters

    from kestrel.ops.moe.grouped import _GatherUp, combine_down

    T, A, E, D = 8, 3, 5, 32
    ids, order, inv, weights, _ = _pairs_and_rows(T, A, E, D, seed=17, dtype=torch.bfloat16)
    offs = _offs(ids, order, E)
    x0 = torch.randn(T, D, generator=torch.Generator().manual_seed(18)).bfloat16()
    w13 = torch.randn(E, D, D, generator=torch.Generator().manual_seed(19))
    w2_0 = torch.randn(E, D, D, generator=torch.Generator().manual_seed(20)) / D**0.5
    in_range = (ids >= 0) & (ids < E)

    def run():
        x, w, w2 = (
            x0.clone().requires_grad_(),
            weights.clone().requires_grad_(),
            w2_0.clone().requires_grad_(),
        )
        up = _GatherUp.apply(x, w13, order, inv, offs, in_range, False)
        out = combine_down(up.square(), w2, offs, order, inv, w, in_range, False)
        out.square().sum().backward()
        return out, x.grad, w.grad, w2.grad

    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "off")
    want = run()
    monkeypatch.setenv("KESTREL_COMPILE_TRAIN", "on")
    torch._dynamo.reset()
    counters.clear()
    got = run()
    # the sum; the rows of token gradients and the three gradients from them; the pair rows' gradient
    assert counters["stats"]["unique_graphs"] == 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)
