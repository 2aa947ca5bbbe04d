"""Checkpoint round trips (one file, shards, MXFP4 experts), transformers' module layout, and every broken
checkpoint raising one CheckpointError that lists the problem."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.config import ModelConfig
from kestrel.models import weights
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model, init_random_weights
from kestrel.models.weights import save_checkpoint
from kestrel.ops.quant.mxfp4 import pack_mxfp4, unpack_mxfp4
from kestrel.presets import preset_config
from kestrel.utils.errors import CheckpointError, ConfigError
from tests.hf_reference import torch_only_kimi_linear

IDS = torch.tensor([256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100])


def _random_model(config: ModelConfig, seed: int = 0) -> KimiForCausalLM:
    model = init_random_weights(KimiForCausalLM(config), seed)
    with (
        torch.no_grad()
    ):  # non-trivial values where the init leaves constants (norms, AttnRes queries, biases)
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("res_proj.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _assert_same_params(a: KimiForCausalLM, b: KimiForCausalLM):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


def _logits(model: KimiForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def saved(request, tmp_path_factory):
    """(model, folder) for the tiny preset in one checkpoint format."""
    model = _random_model(preset_config("tiny", request.param))
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(model, path)
    return model, path


# -- round trips -------------------------------------------------------------------------------------------


def test_save_load_is_exact(saved):
    model, path = saved
    loaded = build_model(str(path))
    assert loaded.config == model.config
    _assert_same_params(model, loaded)
    assert torch.equal(_logits(model), _logits(loaded))


def test_checkpoint_names_follow_the_format(saved):
    model, path = saved
    names = set(_tensors(path))
    k3 = model.config.model_type == "kimi_k3"
    assert all(n.startswith("language_model.") for n in names) == k3
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in names)
    assert any(".self_attn.q_conv1d.weight" in n for n in names)
    assert not any("qkv_proj" in n or "gate_up_proj" in n or "experts.w13" in n for n in names)


def test_sharded_save_writes_an_index_and_loads_exactly(saved, tmp_path):
    model, _ = saved
    save_checkpoint(model, tmp_path, max_shard_bytes=256 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards
    on_disk = {}
    for shard in shards:
        on_disk.update({name: shard for name in load_file(str(tmp_path / shard))})
    assert on_disk == index["weight_map"]
    loaded = build_model(str(tmp_path))
    _assert_same_params(model, loaded)
    assert torch.equal(_logits(model), _logits(loaded))
    # saving again as one file removes the stale shards and index
    save_checkpoint(model, tmp_path)
    assert [p.name for p in tmp_path.glob("*.safetensors*")] == ["model.safetensors"]
    _assert_same_params(model, build_model(str(tmp_path)))


def test_a_failed_save_leaves_no_weights_file(saved, tmp_path, monkeypatch):
    """A save that fails (a full disk) leaves no empty weights file to be read as a truncated checkpoint."""

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(saved[0], tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))


def test_saved_weights_get_the_mode_of_the_other_files(saved, tmp_path):
    """The weights are as readable as config.json (safetensors wrote them 0600), in one file or in shards."""
    model, _ = saved
    for shard_bytes in (None, 256 * 1024):
        save_checkpoint(model, tmp_path, max_shard_bytes=shard_bytes)
        config_mode = (tmp_path / "config.json").stat().st_mode & 0o777
        assert {p.stat().st_mode & 0o777 for p in tmp_path.glob("*.safetensors")} == {config_mode}


def test_bfloat16_model_round_trips(tmp_path):
    model = init_random_weights(KimiForCausalLM(preset_config("tiny"), torch.bfloat16))
    save_checkpoint(model, tmp_path)
    _assert_same_params(model, build_model(str(tmp_path), dtype=torch.bfloat16))


# -- MXFP4 experts -----------------------------------------------------------------------------------------


def _mxfp4_config() -> ModelConfig:
    return preset_config("tiny").replace(
        routed_expert_hidden_size=64, moe_intermediate_size=32, experts_mxfp4=True
    )


@pytest.fixture(scope="module")
def mxfp4_saved(tmp_path_factory):
    model = _random_model(_mxfp4_config())
    path = tmp_path_factory.mktemp("mxfp4")
    save_checkpoint(model, path)
    return model, path


def test_mxfp4_checkpoint_packs_routed_experts_only(mxfp4_saved):
    model, path = mxfp4_saved
    assert (
        json.loads((path / "config.json").read_text())["quantization_config"]["format"]
        == "mxfp4-pack-quantized"
    )
    tensors = _tensors(path)
    routed = {n: t for n, t in tensors.items() if ".experts." in n and "shared_experts" not in n}
    E, I, D = model.config.num_experts, model.config.moe_intermediate_size, model.config.expert_input_size
    n_moe = sum(t == "moe" for t in model.config.mlp_types)
    assert len(routed) == n_moe * E * 3 * 2  # (w1, w2, w3) x (packed, scale) per expert
    for name, t in routed.items():
        assert name.endswith((".weight_packed", ".weight_scale")) and t.dtype == torch.uint8, name
        rows, cols = (D, I) if ".w2." in name else (I, D)
        assert t.shape == ((rows, cols // 2) if name.endswith("packed") else (rows, cols // 32)), name
    others = [t for n, t in tensors.items() if n not in routed]
    assert all(t.dtype == torch.float32 for t in others)
    assert any("shared_experts.gate_proj.weight" in n for n in tensors)


def test_mxfp4_load_dequantizes_to_the_round_trip_of_the_originals(mxfp4_saved):
    model, path = mxfp4_saved
    loaded = build_model(str(path))
    expected = {}
    for name, p in model.named_parameters():
        if name.endswith(("mlp.experts.w13", "mlp.experts.w2")):
            expected[name] = unpack_mxfp4(
                *pack_mxfp4(p.detach()), torch.float32
            )  # blocks run along the last dim
        else:
            expected[name] = p.detach()
    got = dict(loaded.named_parameters())
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
    some = "model.layers.1.mlp.experts.w13"
    assert not torch.equal(got[some], dict(model.named_parameters())[some])  # MXFP4 really is lossy
    assert torch.isfinite(_logits(loaded)).all()


def test_mxfp4_second_round_trip_is_exact(mxfp4_saved, tmp_path):
    _, path = mxfp4_saved
    once = build_model(str(path))
    save_checkpoint(once, tmp_path)
    first, second = _tensors(path), _tensors(tmp_path)
    assert first.keys() == second.keys()
    for name, t in second.items():
        assert t.dtype == first[name].dtype and torch.equal(t, first[name]), name
    twice = build_model(str(tmp_path))
    _assert_same_params(once, twice)
    assert torch.equal(_logits(once), _logits(twice))


# -- transformers' module layout ---------------------------------------------------------------------------


def test_transformers_module_layout_lands_in_the_right_slices(tmp_path):
    """Names from transformers' KimiLinearForCausalLM.state_dict(): fused conv1d, forget_gate.*, stacked
    experts. Sizes chosen so that no two of D, 2I, P coincide: a transposed or misplaced slice cannot fit."""
    from transformers import KimiLinearConfig

    hf_config = KimiLinearConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=20,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=24,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config={
            "head_dim": 16,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 3],
            "full_attn_layers": [2],
        },
    )
    torch.manual_seed(0)
    hf = torch_only_kimi_linear().KimiLinearForCausalLM(hf_config)
    state = {k: torch.randn(v.shape) for k, v in hf.state_dict().items()}  # distinct values everywhere
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    assert (
        "model.layers.0.self_attn.conv1d.weight" in state
        and "model.layers.0.self_attn.forget_gate.A_log" in state
    )
    hf_config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))

    ours = dict(build_model(str(tmp_path)).named_parameters())  # no error: nothing missing or unexpected
    P = 2 * 16
    kda = "model.layers.0.self_attn."
    # in_proj: q | k | v | f_a | b | g_a, each checkpoint tensor in its rows
    parts = ours[kda + "in_proj.weight"].split([P, P, P, 16, 2, 16])
    names = ["q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "b_proj", "g_a_proj"]
    for part, name in zip(parts, names):
        assert torch.equal(part, state[kda + name + ".weight"]), name
    assert torch.equal(ours[kda + "conv_weight"], state[kda + "conv1d.weight"].squeeze(1))
    assert torch.equal(ours[kda + "A_log"], state[kda + "forget_gate.A_log"].flatten())
    assert torch.equal(ours[kda + "dt_bias"], state[kda + "forget_gate.dt_bias"])
    assert torch.equal(ours[kda + "f_b_proj.weight"], state[kda + "forget_gate.f_b_proj.weight"])
    dense = "model.layers.0.mlp."
    gate_up = torch.cat([state[dense + "gate_proj.weight"], state[dense + "up_proj.weight"]])
    assert torch.equal(ours[dense + "gate_up_proj.weight"], gate_up)
    moe = "model.layers.1.mlp."
    assert torch.equal(ours[moe + "experts.w13"], state[moe + "experts.gate_up_proj"])
    assert torch.equal(ours[moe + "experts.w2"], state[moe + "experts.down_proj"])
    assert torch.equal(
        ours[moe + "gate.e_score_correction_bias"], state[moe + "gate.e_score_correction_bias"]
    )
    shared = torch.cat(
        [state[moe + "shared_experts.gate_proj.weight"], state[moe + "shared_experts.up_proj.weight"]]
    )
    assert torch.equal(ours[moe + "shared_experts.gate_up_proj.weight"], shared)
    for name, t in state.items():  # every tensor whose name Kestrel shares is copied as is
        if name in ours:
            assert torch.equal(ours[name], t), name


# -- broken checkpoints ------------------------------------------------------------------------------------


@pytest.fixture
def broken(saved, tmp_path):
    """A writable copy of the saved tiny checkpoint (each format), to break."""
    _, path = saved
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _edit(path, fn):
    tensors = _tensors(path)
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        build_model(str(path))
    message = str(info.value)
    assert "\n" not in message
    return message


def _name(tensors, suffix: str) -> str:
    (name,) = [n for n in tensors if n.endswith(suffix)]
    return name


def test_missing_tensor(broken):
    _edit(broken, lambda t: t.pop(_name(t, "model.norm.weight")))
    message = _load_error(broken)
    assert "missing (1)" in message and "model.norm.weight" in message


def test_missing_slice_of_a_merged_parameter(broken):
    _edit(broken, lambda t: t.pop(_name(t, "layers.0.self_attn.k_proj.weight")))
    assert "model.layers.0.self_attn.in_proj.weight [k]" in _load_error(broken)


def test_a_kda_output_gate_of_the_other_kind_is_reported(broken):
    """A low-rank gate's g_a_proj in a full-rank-gate checkpoint (or the reverse) is one clear error naming it,
    the missing gate slice beside it."""

    def swap(tensors):
        name = next(n for n in tensors if re.search(r"layers\.0\.self_attn\.g(_a)?_proj\.weight$", n))
        other = name.replace("g_proj", "g_a_proj") if "g_proj" in name else name.replace("g_a_proj", "g_proj")
        tensors[other] = tensors.pop(name)

    _edit(broken, swap)
    message = _load_error(broken)
    assert "unexpected" in message and "in_proj.weight [g" in message


def test_missing_expert(broken):
    _edit(broken, lambda t: t.pop(_name(t, "layers.2.block_sparse_moe.experts.5.w3.weight")))
    assert "model.layers.2.mlp.experts.w13 [expert 5 w3]" in _load_error(broken)


def test_unexpected_tensors(broken):
    def add(t):
        prefix = _name(t, "model.norm.weight").removesuffix("model.norm.weight")
        t[prefix + "model.layers.0.self_attn.extra.weight"] = torch.zeros(4)
        t[prefix + "model.layers.1.block_sparse_moe.experts.8.w1.weight"] = torch.zeros(32, 48)  # 8 experts
        t["something.else"] = torch.zeros(1)

    _edit(broken, add)
    message = _load_error(broken)
    assert "unexpected (3)" in message and "missing" not in message
    assert "layers.0.self_attn.extra.weight" in message and "something.else" in message
    assert "experts.8.w1.weight" in message


def test_wrong_shapes(broken):
    def corrupt(t):
        t[_name(t, "model.norm.weight")] = torch.zeros(65)
        t[_name(t, "layers.0.self_attn.q_proj.weight")] = torch.zeros(31, 64)
        t[_name(t, "layers.2.self_attn.kv_b_proj.weight")] = torch.zeros(())  # a scalar

    _edit(broken, corrupt)
    message = _load_error(broken)
    assert "unusable (3)" in message and "missing" not in message  # listed once, as unusable
    assert "(65,)" in message and "(31, 64)" in message and "scalar" in message


def test_integer_or_non_finite_weights(broken):
    """A weight stored as integers, or holding NaN or infinity, is refused by name (both loaded silently)."""

    def corrupt(t):
        t[_name(t, "model.norm.weight")] = torch.ones(
            t[_name(t, "model.norm.weight")].shape, dtype=torch.int32
        )
        for suffix, index, value in (
            ("layers.0.self_attn.q_proj.weight", (3, 5), "nan"),
            ("embed_tokens.weight", (0, 0), "inf"),
        ):
            name = _name(t, suffix)
            t[name] = t[name].clone()
            t[name][index] = float(value)

    _edit(broken, corrupt)
    message = _load_error(broken)
    assert "missing" not in message
    assert "torch.int32, model expects floating point" in message and "norm.weight" in message
    assert "q_proj.weight: NaN or infinite values" in message
    assert "embed_tokens.weight: NaN or infinite values" in message and "unusable (3)" in message


def test_fp8_weights_without_a_scale_are_refused(broken):
    """A float8 weight with no quantization_config for its scale is refused by name (it was upcast as it stood,
    each value off by the scale it lacked)."""

    def to_fp8(t):
        name = _name(t, "layers.0.self_attn.q_proj.weight")
        t[name] = t[name].to(torch.float8_e4m3fn)

    _edit(broken, to_fp8)
    message = _load_error(broken)
    assert (
        "q_proj.weight: torch.float8_e4m3fn without a scale" in message and "quantization_config" in message
    )
    assert "unusable (1)" in message and "missing" not in message


def test_truncated_file(broken):
    file = broken / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    message = _load_error(broken)
    assert "model.safetensors" in message and "truncated" in message


@pytest.mark.parametrize("garbage", [b"\xff" * 8, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"])
def test_corrupted_header(broken, garbage):
    file = broken / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[: len(garbage)] = garbage
    file.write_bytes(bytes(data))
    message = _load_error(broken)
    assert "model.safetensors" in message and "corrupted" in message


def test_index_pointing_to_a_missing_shard(saved, tmp_path):
    model, _ = saved
    save_checkpoint(model, tmp_path, max_shard_bytes=256 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / gone).unlink()
    message = _load_error(tmp_path)
    assert gone in message and "missing" in message


@pytest.mark.parametrize(
    "index", ['{"weight_map": ', '{"metadata": {}}', "[]", '{"weight_map": []}', '{"weight_map": {"a": 1}}']
)
def test_malformed_index(broken, index):
    (broken / "model.safetensors.index.json").write_text(index)
    assert "model.safetensors.index.json: malformed index" in _load_error(broken)


def test_folder_without_weights(broken):
    (broken / "model.safetensors").unlink()
    assert "no safetensors weights" in _load_error(broken)


def test_mxfp4_packed_tensor_without_its_scale(mxfp4_saved, tmp_path):
    _, path = mxfp4_saved
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    scale = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    _edit(tmp_path, lambda t: t.pop(scale))
    message = _load_error(tmp_path)
    assert scale in message and "experts.3.w2.weight_packed" in message
    assert "model.layers.1.mlp.experts.w2 [expert 3 w2]" in message  # and the expert is reported missing


def test_mxfp4_scale_of_the_wrong_shape(mxfp4_saved, tmp_path):
    _, path = mxfp4_saved
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    scale = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    _edit(tmp_path, lambda t: t.update({scale: torch.zeros(64, 3, dtype=torch.uint8)}))
    message = _load_error(tmp_path)
    assert scale in message and "MXFP4" in message and "missing" not in message  # unusable, listed once


def test_bad_config_in_a_checkpoint_folder(broken):
    (broken / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json"):
        build_model(str(broken))
    (broken / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        build_model(str(broken))


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers"])
def test_a_config_too_large_for_memory_is_one_clear_error(broken, key):
    """A config.json whose sizes no memory holds (damaged, or a model too large for the device): one line naming
    the model, not the allocator's RuntimeError (or a MemoryError) as a traceback."""
    raw = json.loads((broken / "config.json").read_text())
    text = raw.get("text_config", raw)
    text[key] = 10**12  # (layers: the list of their types is what does not fit)
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"model '{broken}' does not fit the CPU memory") as info:
        build_model(str(broken))
    assert "\n" not in str(info.value)


def test_build_model_with_a_bad_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        build_model(str(tmp_path / "nowhere"))
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(CheckpointError, match="expected a checkpoint folder, got a file"):
        build_model(str(file))
