"""Model-level consistency on the `tiny` preset (every feature on: KDA lower-bound gate, gated MLA + DSA with
a small top-k, latent MoE, SiTU, AttnRes blocks): one full forward equals chunked prefill and token-by-token
decode through the caches; packed batches equal single sequences; DSA with a large top-k equals dense MLA."""

from __future__ import annotations

import pytest
import torch

from kestrel.layers.context import forward_context
from kestrel.models.cache import DenseCache
from kestrel.models.generate import generate
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model, init_random_weights
from kestrel.presets import preset_config

TOL = 1e-5


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", seed=3)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _run_pieces(model, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Feed one sequence in pieces through a dense cache; logits of every position, concatenated."""
    cache = DenseCache(model.config, 1, sum(len(p) for p in pieces), torch.float32, "cpu")
    outs = []
    with torch.no_grad():
        for piece in pieces:
            ctx = cache.context([0], [len(piece)])
            with forward_context(ctx):
                outs.append(model(piece))
            cache.commit(ctx)
    return torch.cat(outs)


def test_tiny_has_every_feature(tiny):
    c = tiny.config
    assert c.layer_pattern == "LLSLLS" and c.use_dsa and c.index_topk < 40
    assert c.kda_gate_lower_bound is not None and c.kda_full_rank_gate and c.mla_output_gate
    assert c.hidden_act == "situ" and c.routed_expert_hidden_size and c.attn_res_block_size == 2
    assert c.mlp_types[0] == "dense" and c.num_shared_experts and c.num_expert_group > 1


def test_prefill_then_decode_equals_full_forward(tiny):
    ids = _ids(40)
    with torch.no_grad():
        full = tiny(ids)
    stepwise = _run_pieces(tiny, [ids[:10]] + [ids[t : t + 1] for t in range(10, 40)])
    assert _rel(full, stepwise) <= TOL


def test_attn_res_buffer_at_inference_equals_the_training_bank(tiny, monkeypatch):
    """At inference the AttnRes bank lives in one buffer updated in place; with autograd on it is a `Bank` (the
    entries copied into a buffer when their block closes, the running sum tracked by autograd). Neither stacks
    its sources; same logits, bit for bit (tiny: 6 layers in blocks of 2, so every layer mixes a bank of 1-3
    sums plus the partial one)."""
    ids = _ids(33, seed=7)
    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(
        torch, "stack", lambda t, *a, **k: (stacked.append(len(t)), real_stack(t, *a, **k))[1]
    )
    with torch.no_grad():
        buffered = tiny(ids)
    with torch.enable_grad():
        listed = tiny(ids)
    assert not stacked  # no mix stacked its sources
    assert torch.equal(buffered, listed.detach())


@pytest.mark.parametrize("cuts", [(1,), (5, 17), (3, 4, 20, 31), (13, 26, 39)])
def test_chunked_prefill_equals_one_prefill(tiny, cuts):
    ids = _ids(45, seed=1)
    bounds = [0, *cuts, 45]
    whole = _run_pieces(tiny, [ids])
    chunked = _run_pieces(tiny, [ids[a:b] for a, b in zip(bounds, bounds[1:])])
    assert _rel(whole, chunked) <= TOL


def test_packed_batch_equals_single_sequences(tiny):
    seqs = [_ids(n, seed=n) for n in (12, 30, 5)]
    singles = [_run_pieces(tiny, [s[:-1], s[-1:]]) for s in seqs]
    cache = DenseCache(tiny.config, 3, 32, torch.float32, "cpu")
    with torch.no_grad():
        ctx = cache.context([0, 1, 2], [len(s) - 1 for s in seqs])  # packed prefill of three prompts
        with forward_context(ctx):
            prefill = tiny(torch.cat([s[:-1] for s in seqs]))
        cache.commit(ctx)
        ctx = cache.context([2, 0, 1], [1, 1, 1])  # one decode step, rows in another order
        with forward_context(ctx):
            decode = tiny(torch.stack([seqs[2][-1], seqs[0][-1], seqs[1][-1]]))
        cache.commit(ctx)
    start = 0
    for s, single in zip(seqs, singles):
        n = len(s) - 1
        assert _rel(single[:n], prefill[start : start + n]) <= TOL
        start += n
    for row, i in enumerate([2, 0, 1]):
        assert _rel(singles[i][-1], decode[row]) <= TOL


def _with_config(model: KimiForCausalLM, config) -> KimiForCausalLM:
    other = KimiForCausalLM(config)
    state = {k: v for k, v in model.state_dict().items() if ".indexer." not in k}
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert not unexpected and all(".indexer." in k for k in missing)
    return other


def test_dsa_with_large_topk_equals_dense_mla(tiny):
    ids = _ids(40, seed=2)
    wide = _with_config(tiny, tiny.config.replace(index_topk=4096))
    wide.load_state_dict(tiny.state_dict())
    dense = _with_config(tiny, tiny.config.replace(index_n_heads=None, index_head_dim=None, index_topk=None))
    with torch.no_grad():
        a, b, sparse = wide(ids), dense(ids), tiny(ids)
    assert torch.equal(a, b)
    assert _rel(a, sparse) > 1e-3, "with top-8 of 40 tokens the DSA model must differ from dense attention"


def test_generate_greedy_and_seeded():
    model = build_model("tiny", seed=5)
    prompt = _ids(23, seed=4).tolist()
    greedy = generate(model, prompt, 12)
    assert greedy == generate(model, prompt, 12, prefill_chunk=5)
    a = generate(model, prompt, 12, temperature=1.0, seed=7)
    assert a == generate(model, prompt, 12, temperature=1.0, seed=7, prefill_chunk=9)
    assert a != generate(model, prompt, 12, temperature=1.0, seed=8)


def test_gradients_reach_every_trained_parameter():
    """The LM loss trains everything but the DSA indexer (its top-k is not differentiable: model-spec 2.3) and
    layer 0's attention-side AttnRes weights (that mix has a single source, the embedding: softmax of one is 1)."""
    model = init_random_weights(KimiForCausalLM(preset_config("tiny")), seed=1)
    with torch.no_grad():  # AttnRes queries start at zero, which zeroes their norms' gradient: move off zero
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.1)
    ids = _ids(33, seed=6)
    logits = model(ids[:-1])
    torch.nn.functional.cross_entropy(logits, ids[1:]).backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert name.endswith("e_score_correction_bias")
            continue
        if ".indexer." in name or name.startswith("model.layers.0.self_attention_res_"):
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"zero gradient: {name}"


def test_routing_and_selection_replay(tiny):
    """Replaying the captured expert ids and DSA selections reproduces the forward exactly; replaying other
    ids changes it (so replay really drives the MoE and the sparse attention)."""
    from kestrel.layers.context import ForwardContext

    ids = _ids(40, seed=9)
    with torch.no_grad():
        ctx = ForwardContext.build([40])
        ctx.routing_capture, ctx.selection_capture = {}, {}
        with forward_context(ctx):
            free = tiny(ids)
        assert set(ctx.routing_capture) == {i for i, t in enumerate(tiny.config.mlp_types) if t == "moe"}
        assert set(ctx.selection_capture) == set(tiny.config.mla_layer_ids)

        replay = ForwardContext.build([40])
        replay.routing_replay, replay.selection_replay = ctx.routing_capture, ctx.selection_capture
        with forward_context(replay):
            assert torch.equal(tiny(ids), free)

        shifted = ForwardContext.build([40])
        shifted.routing_replay = {
            k: (v + 1) % tiny.config.num_experts for k, v in ctx.routing_capture.items()
        }
        with forward_context(shifted):
            assert _rel(free, tiny(ids)) > 1e-3

        causal = ForwardContext.build([40])  # select the most recent tokens instead of the indexer's choice
        k = tiny.config.index_topk
        recent = torch.stack([torch.arange(t - k + 1, t + 1).clamp(min=-1) for t in range(40)])
        recent = torch.where(recent < 0, torch.full_like(recent, -1), recent)
        causal.selection_replay = {layer: [recent] for layer in tiny.config.mla_layer_ids}
        with forward_context(causal):
            assert _rel(free, tiny(ids)) > 1e-3


def test_a_sequence_within_top_k_skips_the_selection(tiny, monkeypatch):
    """A sequence of at most index_topk tokens attends densely without running the indexer (every query would
    select its whole past): the same output as with the selection computed, which a capture still forces (and
    records, every position selected)."""
    import kestrel.layers.mla as mla
    from kestrel.layers.context import ForwardContext

    k = tiny.config.index_topk
    ids = _ids(k, seed=4)
    with torch.no_grad():
        captured = ForwardContext.build([k])
        captured.selection_capture = {}
        with forward_context(captured):
            selected = tiny(ids)
        cols = torch.arange(k)
        whole = torch.where(cols[None, :] <= cols[:, None], cols[None, :], -1)  # row t: 0 .. t, then -1
        for layer in tiny.config.mla_layer_ids:
            (chosen,) = captured.selection_capture[layer]  # [k, k]
            listed = torch.where(chosen < 0, k, chosen).sort(-1).values  # by position, -1 last
            assert torch.equal(torch.where(listed == k, -1, listed), whole)

        def refused(*args, **kwargs):
            raise AssertionError("the indexer ran for a sequence within top-k")

        monkeypatch.setattr(mla, "indexer_scores", refused)
        with forward_context(ForwardContext.build([k])):
            dense = tiny(ids)
        torch.testing.assert_close(dense, selected, rtol=1e-5, atol=1e-5)
        with pytest.raises(AssertionError, match="indexer ran"):  # one token more: the selection runs again
            with forward_context(ForwardContext.build([k + 1])):
                tiny(_ids(k + 1, seed=4))


def test_conditioned_init_rescales_the_same_draws():
    """The "conditioned" init is the upstream draws with the embedding x10 and the residual-output projections
    by 1 / sqrt(2 * layers), everything else bit for bit; an unknown scheme is refused by name."""
    from kestrel.models.loader import RESIDUAL_OUTPUTS

    up = dict(build_model("tiny", seed=3).named_parameters())
    cond = build_model("tiny", seed=3, init="conditioned")
    scale = (2 * cond.config.num_hidden_layers) ** -0.5
    rescaled = 0
    for name, p in cond.named_parameters():
        if name == "model.embed_tokens.weight":
            expected = up[name] * 10.0
        elif name.endswith(RESIDUAL_OUTPUTS):
            expected, rescaled = up[name] * scale, rescaled + 1
        else:
            expected = up[name]
        assert torch.equal(p, expected), name
    assert rescaled >= 2 * cond.config.num_hidden_layers  # an o_proj and an MLP output in every layer
    with pytest.raises(ValueError, match="init scheme 'xavier'"):
        build_model("tiny", init="xavier")
