"""Ready for sharding: under a tensor/expert-parallel layout every rank's weight loaders narrow the same
checkpoint to that rank's part (the layers run on one device today; TP/EP forwards come later)."""

from __future__ import annotations

import pytest
import torch

from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model
from kestrel.models.weights import load_weights, save_checkpoint
from kestrel.utils.dist import ParallelState, parallel_state, set_parallel_state


@pytest.fixture(scope="module")
def full_and_ckpt(tmp_path_factory):
    model = build_model("tiny", seed=11)
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(model, path)
    return model, path


def _rank_model(config, path, **layout) -> KimiForCausalLM:
    previous = set_parallel_state(ParallelState(**layout))
    try:
        model = KimiForCausalLM(config)
        load_weights(model, path)
    finally:
        set_parallel_state(previous)
    assert parallel_state() == previous
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards(full_and_ckpt, rank):
    full, path = full_and_ckpt
    part = _rank_model(full.config, path, tp_rank=rank, tp_size=2)
    F = dict(full.named_parameters())
    R = dict(part.named_parameters())
    kda = "model.layers.0.self_attn."
    P = full.config.kda_proj_dim
    h = P // 2  # local proj dim
    # in_proj, merged column: q, k, v, b and a full-rank g split on their own, f_a and g_a whole on every rank
    full_parts = dict(
        zip(
            part.model.layers[0].self_attn.in_proj.shard_names,
            F[kda + "in_proj.weight"].split(full.model.layers[0].self_attn.in_proj.local_sizes),
        )
    )
    rank_parts = dict(
        zip(
            part.model.layers[0].self_attn.in_proj.shard_names,
            R[kda + "in_proj.weight"].split(part.model.layers[0].self_attn.in_proj.local_sizes),
        )
    )
    assert set(full_parts) >= {"q", "k", "v", "f_a", "b"} and len(full_parts) == 6
    for name, whole in full_parts.items():
        n = whole.shape[0] if name in ("f_a", "g_a") else whole.shape[0] // 2
        start = 0 if name in ("f_a", "g_a") else rank * n
        assert torch.equal(rank_parts[name], whole[start : start + n]), name
    for i, name in enumerate("qkv"):
        assert torch.equal(
            R[kda + "conv_weight"][i * h : (i + 1) * h],
            F[kda + "conv_weight"][i * P + rank * h : i * P + (rank + 1) * h],
        ), name
    heads = full.config.kda_num_heads // 2
    assert torch.equal(R[kda + "A_log"], F[kda + "A_log"][rank * heads : (rank + 1) * heads])
    assert torch.equal(R[kda + "dt_bias"], F[kda + "dt_bias"][rank * h : (rank + 1) * h])
    assert torch.equal(
        R[kda + "o_proj.weight"], F[kda + "o_proj.weight"][:, rank * h : (rank + 1) * h]
    )  # row
    mla = f"model.layers.{full.config.mla_layer_ids[0]}.self_attn."
    for name in ("q_b_proj.weight", "kv_b_proj.weight", "g_proj.weight"):
        n = F[mla + name].shape[0] // 2
        assert torch.equal(R[mla + name], F[mla + name][rank * n : (rank + 1) * n]), name
    for name in ("kv_a_proj_with_mqa.weight", "indexer.wk.weight", "q_a_proj.weight"):  # replicated
        assert torch.equal(R[mla + name], F[mla + name]), name
    mlp = "model.layers.0.mlp."
    inter = full.config.intermediate_size
    n = inter // 2
    for i in range(2):  # gate | up
        assert torch.equal(
            R[mlp + "gate_up_proj.weight"][i * n : (i + 1) * n],
            F[mlp + "gate_up_proj.weight"][i * inter + rank * n : i * inter + (rank + 1) * n],
        )


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_shards(full_and_ckpt, rank):
    full, path = full_and_ckpt
    part = _rank_model(full.config, path, ep_rank=rank, ep_size=2)
    layer = "model.layers.1.mlp.experts."
    F, R = dict(full.named_parameters()), dict(part.named_parameters())
    n = full.config.num_experts // 2
    for name in ("w13", "w2"):
        assert R[layer + name].shape[0] == n
        assert torch.equal(R[layer + name], F[layer + name][rank * n : (rank + 1) * n])
