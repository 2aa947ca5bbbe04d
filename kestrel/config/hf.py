"""Reading a checkpoint's config.json into `ModelConfig`: the keys each format may carry, typed access with
errors that name the field, and the consistency checks."""

from __future__ import annotations

import math
from typing import Any

from kestrel.config.model import DENSE, KDA, MLA, MOE, ModelConfig
from kestrel.utils.errors import ConfigError

# Keys a config.json may carry that say nothing about the math of the text model.
_METADATA_KEYS = {
    "architectures",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "_name_or_path",
    "output_router_logits",
    "pretraining_tp",
    "attention_dropout",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "model_max_length",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tokenizer_class",
    "problem_type",
    "id2label",
    "label2id",
    "rope_theta",
    "head_dim",
    "qk_head_dim",
    "linear_conv_kernel_dim",
    "linear_head_dim",
    "linear_num_heads",
    "router_aux_loss_coef",
    "aux_loss_alpha",
    "tie_word_embeddings",
    "kestrel",
}
# Keys that must hold a given value: Kestrel implements only that value.
_FIXED_KEYS: dict[str, Any] = {
    "attention_bias": False,
    "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid",
    "num_nextn_predict_layers": 0,
    "rope_scaling": None,
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rms_norm_eps",
    "linear_attn_config",
)
_OPTIONAL = {
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "routed_scaling_factor",
    "moe_renormalize",
    "use_grouped_topk",
    "num_expert_group",
    "topk_group",
    "first_k_dense_replace",
    "moe_layer_freq",
    "mlp_layer_types",
    "layer_types",
    "q_lora_rank",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "mla_use_output_gate",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "attn_res_block_size",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "num_key_value_heads",
    "quantization_config",
    "model_type",
}
_LINEAR_ATTN_KEYS = {
    "head_dim",
    "num_heads",
    "short_conv_kernel_size",
    "kda_layers",
    "full_attn_layers",
    "gate_lower_bound",
    "use_full_rank_gate",
}
# transformers writes these aliases (attribute_map of KimiLinearConfig) next to or instead of Moonshot's keys.
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
}
_K3_TOP_LEVEL = {
    "text_config",
    "vision_config",
    "media_placeholder_token_id",
    "quantization_config",
    "model_type",
    "ignore_index",
    "image_token_index",
    "projector_hidden_act",
    "projector_ln_eps",
} | _METADATA_KEYS


def parse_k3_config(raw: dict) -> ModelConfig:
    unknown = sorted(set(raw) - _K3_TOP_LEVEL)
    if unknown:
        raise ConfigError(f"unknown config field(s) for kimi_k3: {', '.join(unknown)}")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("text_config: missing or not an object (required for model_type kimi_k3)")
    text = dict(text)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in raw and key not in text:
            text[key] = raw[key]
    quant = raw.get("quantization_config", text.get("quantization_config"))
    return parse_text_config(text, "kimi_k3", quant=quant, where="text_config.")


def parse_text_config(raw: dict, model_type: str, quant: dict | None, where: str) -> ModelConfig:
    raw = dict(raw)
    if raw.get("model_type", "kimi_linear") != "kimi_linear":
        raise ConfigError(f"{where}model_type: {raw.get('model_type')!r} (expected 'kimi_linear')")
    for alias, key in _ALIASES.items():
        if alias in raw:
            value = raw.pop(alias)
            if key in raw and raw[key] != value:
                raise ConfigError(f"{where}{alias}={value!r} disagrees with {key}={raw[key]!r}")
            raw[key] = value

    known = _METADATA_KEYS | set(_FIXED_KEYS) | set(_REQUIRED) | _OPTIONAL
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(where + k for k in unknown)}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"missing config field(s): {', '.join(where + k for k in missing)}")
    for key, want in _FIXED_KEYS.items():
        if key in raw and raw[key] != want:
            raise ConfigError(f"{where}{key}={raw[key]!r} is not supported (Kestrel implements {want!r})")

    r = _Reader(raw, where)
    n_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    lac = raw["linear_attn_config"]
    if not isinstance(lac, dict):
        raise ConfigError(f"{where}linear_attn_config: expected an object")
    bad = sorted(set(lac) - _LINEAR_ATTN_KEYS)
    if bad:
        raise ConfigError(
            f"unknown config field(s): {', '.join(f'{where}linear_attn_config.{k}' for k in bad)}"
        )
    la = _Reader(lac, where + "linear_attn_config.")
    layer_types = _layer_types(raw, lac, n_layers, where)
    mlp_types = _mlp_types(raw, n_layers, where)

    heads = r.int("num_attention_heads")
    if raw.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"{where}num_key_value_heads must equal num_attention_heads for MLA")

    lower_bound = la.opt_float("gate_lower_bound")
    if lower_bound is not None and not lower_bound < 0:
        raise ConfigError(f"{where}linear_attn_config.gate_lower_bound must be negative, got {lower_bound}")

    index = [raw.get(k) for k in ("index_n_heads", "index_head_dim", "index_topk")]
    if any(v is not None for v in index) and not all(v is not None for v in index):
        raise ConfigError(f"{where}index_n_heads, index_head_dim and index_topk must be set together")
    use_dsa = index[0] is not None

    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "situ"):
        raise ConfigError(f"{where}hidden_act={act!r} is not supported (expected 'silu' or 'situ')")
    has_moe = MOE in mlp_types
    # false: plain top-k over every expert, as vLLM reads it, whatever num_expert_group says (transformers' router
    # ignores the flag and always groups, which is what its absence means here)
    grouped = r.bool("use_grouped_topk", True)
    latent = r.opt_int("routed_expert_hidden_size")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if any(isinstance(e, bool) or not isinstance(e, int) for e in eos_ids):
        raise ConfigError(f"{where}eos_token_id={eos!r}: expected an integer or a list of integers")

    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        mlp_types=mlp_types,
        rms_norm_eps=r.float("rms_norm_eps"),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        max_position_embeddings=r.int(
            "model_max_length" if "model_max_length" in raw else "max_position_embeddings", 1 << 20
        ),
        bos_token_id=r.opt_int("bos_token_id", minimum=0),
        eos_token_ids=eos_ids,
        pad_token_id=r.opt_int("pad_token_id", minimum=0),
        kda_num_heads=la.int("num_heads"),
        kda_head_dim=la.int("head_dim"),
        kda_conv_size=la.int("short_conv_kernel_size", 4),
        kda_gate_lower_bound=lower_bound,
        kda_full_rank_gate=la.bool("use_full_rank_gate", False),
        num_attention_heads=heads,
        q_lora_rank=r.opt_int("q_lora_rank"),
        kv_lora_rank=r.int("kv_lora_rank"),
        qk_nope_head_dim=r.int("qk_nope_head_dim"),
        qk_rope_head_dim=r.int("qk_rope_head_dim", minimum=0),
        v_head_dim=r.int("v_head_dim"),
        mla_output_gate=r.bool("mla_use_output_gate", False),
        index_n_heads=r.int("index_n_heads") if use_dsa else None,
        index_head_dim=r.int("index_head_dim") if use_dsa else None,
        index_topk=r.int("index_topk") if use_dsa else None,
        hidden_act=act,
        situ_beta=r.float("activation_situ_beta", 4.0),
        situ_linear_beta=r.float("activation_situ_linear_beta", 25.0),
        intermediate_size=r.int("intermediate_size")
        if DENSE in mlp_types
        else r.int("intermediate_size", 0, 0),
        num_experts=r.int("num_experts") if has_moe else r.int("num_experts", 0, 0),
        num_experts_per_token=r.int("num_experts_per_token")
        if has_moe
        else r.int("num_experts_per_token", 0, 0),
        moe_intermediate_size=r.int("moe_intermediate_size")
        if has_moe
        else r.int("moe_intermediate_size", 0, 0),
        num_shared_experts=r.int("num_shared_experts", 0, minimum=0),
        routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
        moe_renormalize=r.bool("moe_renormalize", True),
        num_expert_group=r.int("num_expert_group", 1) if grouped else 1,
        topk_group=r.int("topk_group", 1) if grouped else 1,
        routed_expert_hidden_size=latent,
        latent_moe_use_norm=r.bool("latent_moe_use_norm", False),
        attn_res_block_size=r.opt_int("attn_res_block_size"),
        experts_mxfp4=_parse_quant(quant, where),
    )
    _check(cfg, where)
    return cfg


def _layer_types(raw: dict, lac: dict, n: int, where: str) -> tuple[str, ...]:
    kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
    types: list[str | None] | None = None
    if kda is not None or full is not None:
        if not isinstance(kda, list) or not isinstance(full, list):
            raise ConfigError(
                f"{where}linear_attn_config: kda_layers and full_attn_layers must both be lists"
            )
        types = [None] * n
        for name, ids, kind in (("kda_layers", kda, KDA), ("full_attn_layers", full, MLA)):
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n:
                    raise ConfigError(
                        f"{where}linear_attn_config.{name}: {i!r} is not a layer in 1..{n} (1-based)"
                    )
                if types[i - 1] is not None:
                    raise ConfigError(
                        f"{where}linear_attn_config: layer {i} is in both kda_layers and full_attn_layers"
                    )
                types[i - 1] = kind
        holes = [i + 1 for i, t in enumerate(types) if t is None]
        if holes:
            raise ConfigError(
                f"{where}linear_attn_config: layers {holes} are in neither kda_layers nor full_attn_layers"
            )
    types = _hf_type_list(
        raw,
        "layer_types",
        {"linear_attention": KDA, "full_attention": MLA},
        n,
        where,
        types,
        "linear_attn_config.kda_layers/full_attn_layers",
    )
    if types is None:
        raise ConfigError(f"missing config field(s): {where}linear_attn_config.kda_layers, full_attn_layers")
    return tuple(types)  # type: ignore[arg-type]


def _hf_type_list(raw: dict, key: str, mapping: dict, n: int, where: str, derived: list | None, source: str):
    """transformers' per-layer list `key` (n entries, each a key of `mapping`) as our layer kinds; it must agree
    with the kinds `derived` from Moonshot's fields (`source`) when both are given. None when neither is."""
    listed = raw.get(key)
    if listed is None:
        return derived
    if (
        not isinstance(listed, list)
        or len(listed) != n
        or any(not isinstance(t, str) or t not in mapping for t in listed)
    ):
        raise ConfigError(f"{where}{key}: expected {n} entries of {'/'.join(mapping)}")
    kinds = [mapping[t] for t in listed]
    if derived is not None and kinds != derived:
        raise ConfigError(f"{where}{key} disagrees with {source}")
    return kinds


def _mlp_types(raw: dict, n: int, where: str) -> tuple[str, ...]:
    first = raw.get("first_k_dense_replace")
    freq = raw.get("moe_layer_freq", 1)
    types = None
    if first is not None:
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"{where}first_k_dense_replace must be a non-negative integer")
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"{where}moe_layer_freq must be a positive integer")
        types = [MOE if i >= first and i % freq == 0 else DENSE for i in range(n)]
    types = _hf_type_list(
        raw,
        "mlp_layer_types",
        {"dense": DENSE, "sparse": MOE},
        n,
        where,
        types,
        "first_k_dense_replace/moe_layer_freq",
    )
    if types is None:
        types = [
            DENSE if i < 1 else MOE for i in range(n)
        ]  # transformers' default: first_k_dense_replace = 1
    return tuple(types)


def _parse_quant(quant: dict | None, where: str) -> bool:
    if quant is None:
        return False
    if not isinstance(quant, dict):
        raise ConfigError(f"{where}quantization_config: expected an object")
    method, fmt = quant.get("quant_method"), quant.get("format")
    if method == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
        return True
    raise ConfigError(
        f"quantization_config: quant_method={method!r} format={fmt!r} is not supported "
        "(Kestrel reads compressed-tensors mxfp4-pack-quantized experts)"
    )


def _check(c: ModelConfig, where: str) -> None:
    def fail(msg: str):
        raise ConfigError(where + msg)

    if not c.rms_norm_eps > 0:  # RMSNorm's 1 / sqrt(mean(x^2) + eps): NaN or inf from the first norm
        fail(f"rms_norm_eps={c.rms_norm_eps} must be > 0")
    if c.qk_nope_head_dim <= 0 or c.v_head_dim <= 0:
        fail("qk_nope_head_dim and v_head_dim must be positive")
    if MOE in c.mlp_types:
        if c.num_experts_per_token > c.num_experts:
            fail(f"num_experts_per_token={c.num_experts_per_token} exceeds num_experts={c.num_experts}")
        if c.num_experts % c.num_expert_group:
            fail(f"num_experts={c.num_experts} is not divisible by num_expert_group={c.num_expert_group}")
        if c.topk_group > c.num_expert_group:
            fail(f"topk_group={c.topk_group} exceeds num_expert_group={c.num_expert_group}")
        per_group = c.num_experts // c.num_expert_group
        if c.num_expert_group > 1 and per_group < 2:
            fail(f"num_expert_group={c.num_expert_group}: grouped routing needs at least 2 experts per group")
        if c.num_experts_per_token > c.topk_group * per_group:
            fail(f"num_experts_per_token={c.num_experts_per_token} exceeds the experts in topk_group groups")
    if c.experts_mxfp4 and (c.expert_input_size % 32 or c.moe_intermediate_size % 32):
        fail(
            f"moe_intermediate_size={c.moe_intermediate_size}, expert input size={c.expert_input_size} "
            "(routed_expert_hidden_size or hidden_size): MXFP4 experts need multiples of 32 (the MX block)"
        )
    if c.routed_expert_hidden_size is None and c.latent_moe_use_norm:
        fail("latent_moe_use_norm needs routed_expert_hidden_size")
    if c.use_dsa and MLA not in c.layer_types:
        fail("index_topk is set but the model has no full-attention layer for the indexer")
    if c.attn_res_block_size is not None and c.attn_res_block_size < 1:
        fail("attn_res_block_size must be >= 1")
    for name in ("bos_token_id", "pad_token_id"):
        value = getattr(c, name)
        if value is not None and not 0 <= value < c.vocab_size:
            fail(f"{name}={value} is outside the vocabulary (vocab_size={c.vocab_size})")
    for value in c.eos_token_ids:
        if not isinstance(value, int) or not 0 <= value < c.vocab_size:
            fail(f"eos_token_id={value} is outside the vocabulary (vocab_size={c.vocab_size})")


class _Reader:
    """Typed access to one JSON object, with errors that name the field."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def _get(self, key: str, default):
        if key not in self.raw or self.raw[key] is None:
            if default is _NO_DEFAULT:
                raise ConfigError(f"missing config field(s): {self.where}{key}")
            return default
        return self.raw[key]

    def int(self, key: str, default=None, minimum: int = 1) -> int:
        value = self._get(key, _NO_DEFAULT if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.where}{key}={value!r}: expected an integer >= {minimum}")
        return value

    def opt_int(self, key: str, minimum: int = 1) -> int | None:
        return None if self.raw.get(key) is None else self.int(key, minimum=minimum)

    def bool(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}{key}={value!r}: expected true or false")
        return value

    def float(self, key: str, default=None) -> float:
        value = self._get(key, _NO_DEFAULT if default is None else default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.where}{key}={value!r}: expected a number")
        if not math.isfinite(value):  # Python's json reads NaN and Infinity: every output would be NaN
            raise ConfigError(f"{self.where}{key}={value!r}: expected a finite number")
        return float(value)

    def opt_float(self, key: str) -> float | None:
        return None if self.raw.get(key) is None else self.float(key)


_NO_DEFAULT = object()
