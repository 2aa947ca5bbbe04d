"""The one config path: presets and transformers-written configs parse and round-trip; every bad config raises
one ConfigError whose message names the offending field."""

from __future__ import annotations

import copy
import json

import pytest

from kestrel.config import DENSE, KDA, MLA, MOE, ModelConfig
from kestrel.presets import preset_config, preset_hf_config, preset_names
from kestrel.utils.errors import ConfigError

FORMATS = ("kimi_k3", "kimi_linear")


def _round_trip(config: ModelConfig) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(json.dumps(config.to_hf())))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", preset_names())
def test_preset_parses_and_round_trips(name, fmt, tmp_path):
    config = preset_config(name, fmt)
    assert config.model_type == fmt
    assert len(config.layer_types) == len(config.mlp_types) == config.num_hidden_layers
    assert _round_trip(config) == config
    assert _round_trip(_round_trip(config)) == config
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    assert ModelConfig.from_hf(tmp_path) == config
    assert ModelConfig.from_hf(tmp_path / "config.json") == config


def test_kimi_linear_format_drops_k3_features():
    config = preset_config("tiny", "kimi_linear")
    assert not config.use_dsa and not config.mla_output_gate and config.hidden_act == "silu"
    assert config.routed_expert_hidden_size is None and config.attn_res_block_size is None
    assert config.kda_gate_lower_bound is None and not config.kda_full_rank_gate
    k3 = preset_config("tiny", "kimi_k3")
    assert k3.use_dsa and k3.layer_pattern == "LLSLLS" and config.layer_pattern == "LLALLA"


def test_replace_revalidates_and_round_trips():
    config = preset_config("tiny").replace(routed_expert_hidden_size=64, experts_mxfp4=True)
    assert config.experts_mxfp4 and config.to_hf()["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert _round_trip(config) == config
    with pytest.raises(ConfigError, match="num_experts_per_token"):
        preset_config("tiny").replace(num_experts_per_token=99)


# -- what transformers writes ---------------------------------------------------------------------------


def _transformers_config():
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=3,
        kv_lora_rank=20,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        linear_attn_config={
            "head_dim": 16,
            "num_heads": 3,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 4],
            "full_attn_layers": [3],
        },
    )


def _check_transformers_fields(config: ModelConfig):
    assert config.model_type == "kimi_linear"
    assert config.layer_types == (KDA, KDA, MLA, KDA)
    assert config.mlp_types == (DENSE, DENSE, MOE, MOE)
    assert (config.num_experts, config.num_experts_per_token, config.num_shared_experts) == (8, 3, 2)
    assert (config.num_expert_group, config.topk_group, config.moe_renormalize) == (2, 1, False)
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (1, (2,), 0)
    assert (config.kda_num_heads, config.kda_head_dim, config.kda_conv_size) == (3, 16, 4)
    assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim) == (16, 20, 12)
    assert not config.use_dsa and config.hidden_act == "silu"


def test_transformers_save_pretrained_parses(tmp_path):
    _transformers_config().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in raw and "mlp_layer_types" in raw  # transformers writes both derived lists
    config = ModelConfig.from_hf(tmp_path)
    _check_transformers_fields(config)
    assert _round_trip(config) == config


def test_transformers_json_string_and_alias_keys_parse():
    raw = json.loads(_transformers_config().to_json_string())
    _check_transformers_fields(ModelConfig.from_dict(raw))
    # the attribute_map aliases, in place of Moonshot's keys
    aliased = dict(raw)
    for alias, key in {
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "n_group": "num_expert_group",
        "norm_topk_prob": "moe_renormalize",
    }.items():
        aliased[alias] = aliased.pop(key)
    _check_transformers_fields(ModelConfig.from_dict(aliased))
    # both spellings at once are fine when they agree, an error naming both when they do not
    both = dict(raw, num_local_experts=8)
    _check_transformers_fields(ModelConfig.from_dict(both))
    with pytest.raises(ConfigError, match="num_local_experts.*num_experts"):
        ModelConfig.from_dict(dict(raw, num_local_experts=4))


def test_transformers_layer_lists_alone_define_the_layout():
    """layer_types / mlp_layer_types without the Moonshot keys that they are derived from."""
    raw = json.loads(_transformers_config().to_json_string())
    del raw["linear_attn_config"]["kda_layers"], raw["linear_attn_config"]["full_attn_layers"]
    del raw["first_k_dense_replace"]
    _check_transformers_fields(ModelConfig.from_dict(raw))


def test_k3_text_config_nesting_with_top_level_tokens():
    raw = preset_hf_config("tiny", "kimi_k3")
    text = raw["text_config"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        del text[key]
    raw.update(bos_token_id=5, eos_token_id=[6, 7], pad_token_id=8)
    config = ModelConfig.from_dict(raw)
    assert config.model_type == "kimi_k3"
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (5, (6, 7), 8)
    assert config.use_dsa and config.attn_res_block_size == 2
    # the text_config's own ids win over the top level's
    raw["text_config"]["bos_token_id"] = 9
    assert ModelConfig.from_dict(raw).bos_token_id == 9
    # a K3 top level may carry the multimodal keys, which the text model ignores
    raw.update(vision_config={"anything": 1}, media_placeholder_token_id=3)
    assert ModelConfig.from_dict(raw).num_hidden_layers == 6


def test_use_grouped_topk_false_routes_over_every_expert():
    """use_grouped_topk false is plain top-k, whatever num_expert_group says (the flag was never read: the
    groups still limited which experts a token could pick)."""
    raw = preset_config("tiny", "kimi_linear").to_hf()
    assert raw["use_grouped_topk"] and (raw["num_expert_group"], raw["topk_group"]) == (2, 1)
    plain = ModelConfig.from_dict(dict(raw, use_grouped_topk=False))
    assert (plain.num_expert_group, plain.topk_group) == (1, 1)
    assert _round_trip(plain) == plain
    # groups that would not even split the experts do not matter then
    assert ModelConfig.from_dict(dict(raw, use_grouped_topk=False, num_expert_group=3)).num_expert_group == 1
    # true, or absent (transformers writes no such key and always groups): grouped as configured
    del raw["use_grouped_topk"]
    assert (ModelConfig.from_dict(raw).num_expert_group, ModelConfig.from_dict(raw).topk_group) == (2, 1)


# -- bad configs: each raises ConfigError naming the field ------------------------------------------------


def _set(*path_and_value):
    *path, value = path_and_value

    def mutate(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return mutate


def _del(*path):
    def mutate(d):
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]

    return mutate


def _lac(**fields):
    return lambda d: d["linear_attn_config"].update(fields)


_MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}

# id: (mutation of the tiny preset's kimi_linear config dict, text the message must contain)
BAD_LINEAR = {
    "missing-required": (_del("hidden_size"), "hidden_size"),
    "missing-lac-field": (_del("linear_attn_config", "num_heads"), "linear_attn_config.num_heads"),
    "missing-layer-lists": (_set("linear_attn_config", {"head_dim": 16, "num_heads": 2}), "kda_layers"),
    "missing-model-type": (_del("model_type"), "model_type"),
    "unsupported-model-type": (_set("model_type", "llama"), "model_type"),
    "unknown-field": (_set("hidden_sise", 64), "hidden_sise"),
    "unknown-lac-field": (_lac(kda_layer=[1]), "linear_attn_config.kda_layer"),
    "layers-overlap": (_lac(kda_layers=[1, 2, 3, 4, 5], full_attn_layers=[3, 6]), "layer 3"),
    "layers-hole": (_lac(kda_layers=[1, 2, 4], full_attn_layers=[3, 6]), "layers [5]"),
    "layers-out-of-range": (_lac(kda_layers=[1, 2, 4, 5, 7], full_attn_layers=[3, 6]), "kda_layers: 7"),
    "layers-zero-based": (_lac(kda_layers=[0, 1, 3, 4], full_attn_layers=[2, 5]), "kda_layers: 0"),
    "layers-bool-entry": (_lac(kda_layers=[True, 2, 4, 5], full_attn_layers=[3, 6]), "kda_layers: True"),
    "layers-not-a-list": (_lac(full_attn_layers="3,6"), "full_attn_layers"),
    "layer-types-disagree": (
        _set("layer_types", ["full_attention"] + ["linear_attention"] * 5),
        "layer_types",
    ),
    "layer-types-length": (_set("layer_types", ["linear_attention"] * 5), "layer_types"),
    "layer-types-entry": (_set("layer_types", ["mamba"] * 6), "layer_types"),
    "layer-types-nested": (_set("layer_types", [["linear_attention"]] * 6), "layer_types"),
    "mlp-layer-types-disagree": (_set("mlp_layer_types", ["sparse"] * 6), "mlp_layer_types"),
    "mlp-layer-types-entry": (_set("mlp_layer_types", ["moe"] * 6), "mlp_layer_types"),
    "mlp-layer-types-nested": (_set("mlp_layer_types", [{"dense": 1}] * 6), "mlp_layer_types"),
    "first-k-dense-negative": (_set("first_k_dense_replace", -1), "first_k_dense_replace"),
    "first-k-dense-bool": (_set("first_k_dense_replace", True), "first_k_dense_replace"),
    "str-for-int": (_set("hidden_size", "64"), "hidden_size"),
    "bool-for-int": (_set("num_attention_heads", True), "num_attention_heads"),
    "float-for-int": (_set("kv_lora_rank", 32.0), "kv_lora_rank"),
    "zero-for-int": (_set("num_hidden_layers", 0), "num_hidden_layers"),
    "str-for-int-lac": (_lac(head_dim="16"), "linear_attn_config.head_dim"),
    "str-for-float": (_set("rms_norm_eps", "1e-5"), "rms_norm_eps"),
    "bool-for-float": (_set("routed_scaling_factor", True), "routed_scaling_factor"),
    # json reads NaN and Infinity; each loaded, and the model's every logit was NaN (greedy: token 0 forever)
    "nan-eps": (_set("rms_norm_eps", float("nan")), "rms_norm_eps=nan: expected a finite number"),
    "inf-float": (_set("routed_scaling_factor", float("inf")), "routed_scaling_factor=inf"),
    "nan-lac-float": (_lac(gate_lower_bound=float("nan")), "linear_attn_config.gate_lower_bound=nan"),
    "negative-eps": (_set("rms_norm_eps", -1e-6), "rms_norm_eps=-1e-06 must be > 0"),
    "zero-eps": (_set("rms_norm_eps", 0), "rms_norm_eps=0.0 must be > 0"),
    "str-for-bool": (_set("tie_word_embeddings", "false"), "tie_word_embeddings"),
    "str-for-context": (_set("model_max_length", "4k"), "model_max_length"),
    "negative-context": (_set("model_max_length", -1), "model_max_length"),
    "lac-not-object": (_set("linear_attn_config", [1, 2]), "linear_attn_config"),
    "topk-exceeds-experts": (_set("num_experts_per_token", 9), "num_experts_per_token"),
    "experts-not-divisible": (_set("num_expert_group", 3), "num_expert_group"),
    "topk-group-exceeds-groups": (_set("topk_group", 3), "topk_group"),
    "grouped-topk-str": (_set("use_grouped_topk", "false"), "use_grouped_topk"),
    "index-only-topk": (_set("index_topk", 8), "index_topk"),
    "mla-use-nope-false": (_set("mla_use_nope", False), "mla_use_nope"),
    "rope-scaling": (_set("rope_scaling", {"type": "yarn"}), "rope_scaling"),
    "kv-heads": (_set("num_key_value_heads", 1), "num_key_value_heads"),
    "hidden-act": (_set("hidden_act", "gelu"), "hidden_act"),
    "router-activation": (_set("moe_router_activation_func", "softmax"), "moe_router_activation_func"),
    "quantization-not-object": (_set("quantization_config", "mxfp4"), "quantization_config"),
    "bos-outside-vocab": (_set("bos_token_id", 261), "bos_token_id"),
    "pad-outside-vocab": (_set("pad_token_id", 10_000), "pad_token_id"),
    "eos-outside-vocab": (_set("eos_token_id", [257, 261]), "eos_token_id=261"),
    "eos-negative": (_set("eos_token_id", -1), "eos_token_id"),
    "bos-str": (_set("bos_token_id", "256"), "bos_token_id"),
    "eos-str": (_set("eos_token_id", "257"), "eos_token_id"),
    "eos-bool": (_set("eos_token_id", [True]), "eos_token_id"),
}

# the same for the kimi_k3 format, where the text model sits under text_config
BAD_K3 = {
    "missing-required": (_del("text_config", "kv_lora_rank"), "text_config.kv_lora_rank"),
    "missing-text-config": (_del("text_config"), "text_config"),
    "text-config-not-object": (_set("text_config", "kimi_linear"), "text_config"),
    "unknown-top-level": (_set("hidden_size", 64), "hidden_size"),
    "unknown-text-config": (_set("text_config", "rope_thetaa", 1.0), "text_config.rope_thetaa"),
    "unknown-lac": (
        _set("text_config", "linear_attn_config", "gate_bound", -1.0),
        "linear_attn_config.gate_bound",
    ),
    "str-for-int": (_set("text_config", "num_hidden_layers", "6"), "text_config.num_hidden_layers"),
    "int-for-bool": (_set("text_config", "mla_use_output_gate", 1), "text_config.mla_use_output_gate"),
    "str-for-bool-lac": (
        _set("text_config", "linear_attn_config", "use_full_rank_gate", "yes"),
        "use_full_rank_gate",
    ),
    "gate-lower-bound-positive": (
        _set("text_config", "linear_attn_config", "gate_lower_bound", 1.0),
        "gate_lower_bound",
    ),
    "index-partial": (_del("text_config", "index_head_dim"), "index_head_dim"),
    "quantization-method": (_set("quantization_config", {"quant_method": "fp8"}), "quantization_config"),
    "quantization-format": (_set("quantization_config", dict(_MXFP4, format="nvfp4")), "quantization_config"),
    "mxfp4-odd-sizes": (_set("quantization_config", _MXFP4), "multiples of 32"),  # latent width 48
    "top-level-bos-outside-vocab": (
        lambda d: (d["text_config"].pop("bos_token_id"), d.update(bos_token_id=163584)),
        "bos_token_id=163584",
    ),
}
BAD = [pytest.param("kimi_linear", *case, id=f"linear-{k}") for k, case in BAD_LINEAR.items()]
BAD += [pytest.param("kimi_k3", *case, id=f"k3-{k}") for k, case in BAD_K3.items()]


@pytest.mark.parametrize("fmt, mutate, field", BAD)
def test_bad_config_names_the_field(fmt, mutate, field):
    raw = copy.deepcopy(preset_hf_config("tiny", fmt))
    mutate(raw)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(raw)
    message = str(info.value)
    assert field in message, message
    assert "\n" not in message


# -- bad config.json files ---------------------------------------------------------------------------------


def test_a_training_runs_folder_points_at_its_checkpoint(tmp_path):
    """`kestrel eval --model runs/demo` (the run, not runs/demo/checkpoint) said only "no config.json"."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=f"a training run's folder\\? its checkpoint is {tmp_path / 'checkpoint'}"
    ):
        ModelConfig.from_hf(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "content, match",
    [
        (b'{"model_type": "kimi_linear",', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[1, 2, 3]", "expected a JSON object"),
        (b'"kimi_linear"', "expected a JSON object"),
        (b"null", "expected a JSON object"),
    ],
    ids=["truncated", "empty", "binary", "list", "string", "null"],
)
def test_malformed_config_json(tmp_path, content, match):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=match) as info:
        ModelConfig.from_hf(tmp_path)
    assert "config.json" in str(info.value)


def test_unknown_preset_and_format():
    with pytest.raises(ConfigError, match="huge"):
        preset_hf_config("huge")
    with pytest.raises(ConfigError, match="kimi_k4"):
        preset_hf_config("tiny", "kimi_k4")


def test_demo_attn4_is_the_demo_with_half_its_layers_mla():
    demo, attn4 = preset_config("demo"), preset_config("demo-attn4")
    assert attn4.layer_types == ("kda", "mla") * 4 and demo.layer_types.count("mla") == 2
    same = (
        "hidden_size",
        "num_hidden_layers",
        "vocab_size",
        "index_topk",
        "num_experts",
        "attn_res_block_size",
    )
    assert all(getattr(attn4, f) == getattr(demo, f) for f in same)


def test_a_page_size_that_does_not_divide_the_checkpoint_interval_is_named():
    from kestrel.config import EngineConfig
    from kestrel.utils.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"checkpoint_interval \(8192\) must be a multiple of page_size \(7\)"
    ):
        EngineConfig(page_size=7)


def test_the_step_size_defaults_by_device():
    """chunked_prefill_size: what is given, else 8192 on a GPU and 512 on the CPU (where one 8,184-token prefill
    step of the demo model took 34.7 s, stalling every stream, and 512-token steps 16.9 s in all)."""
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine

    assert EngineConfig().chunk_size("cuda") == 8192 and EngineConfig().chunk_size("cpu") == 512
    assert EngineConfig(chunked_prefill_size=100).chunk_size("cpu") == 100
    assert EngineConfig(max_running_requests=1000).chunk_size("cpu") == 2000  # room to prefill beside decode
    engine = Engine(EngineConfig(model="tiny", device="cpu"))
    assert engine.scheduler.chunked_prefill_size == 512
