"""The one config path: a checkpoint's HF `config.json` becomes a frozen `ModelConfig` once.

Layers never read HF config objects. Two checkpoint formats are understood (model-spec section 8):
`kimi_linear` (flat; Moonshot's original keys or what transformers writes) and `kimi_k3` (the text model
nested under `text_config`). The DSA fields `index_n_heads`, `index_head_dim`, `index_topk` put a lightning
indexer on every full-attention layer. A missing, unknown or inconsistent field raises `ConfigError` naming it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kestrel.utils.errors import ConfigError

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"

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


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model math needs, validated. Build it with `from_hf` (or `from_dict`)."""

    model_type: str  # checkpoint format: "kimi_linear" | "kimi_k3"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # KDA | MLA, one per layer
    mlp_types: tuple[str, ...]  # DENSE | MOE, one per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # KDA (model-spec 1)
    kda_num_heads: int
    kda_head_dim: int
    kda_conv_size: int
    kda_gate_lower_bound: float | None
    kda_full_rank_gate: bool
    # MLA (model-spec 2.1)
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_output_gate: bool
    # DSA lightning indexer (model-spec 2.3); None when the model has no indexer
    index_n_heads: int | None
    index_head_dim: int | None
    index_topk: int | None
    # MLPs (model-spec 3)
    hidden_act: str  # "silu" | "situ"
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    routed_expert_hidden_size: int | None  # latent MoE width; None = experts act on the full hidden size
    latent_moe_use_norm: bool
    # AttnRes (model-spec 4); None = plain pre-norm residual stream
    attn_res_block_size: int | None
    # Weights format of the routed experts in the checkpoint
    experts_mxfp4: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # -- derived -------------------------------------------------------------------------------------
    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLA)

    @property
    def use_dsa(self) -> bool:
        return self.index_topk is not None

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Latent cache width per token per MLA layer: c_kv + k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_input_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def layer_pattern(self) -> str:
        """One letter a layer: L (KDA, linear) or S (MLA, sparse with DSA) / A (MLA, dense)."""
        full = "S" if self.use_dsa else "A"
        return "".join("L" if t == KDA else full for t in self.layer_types)

    # -- reading ---------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json` (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ConfigError(f"no config.json at {file}")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: expected a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            return _parse_k3(raw)
        if model_type == "kimi_linear":
            return _parse_text(raw, "kimi_linear", quant=raw.get("quantization_config"), where="")
        raise ConfigError(
            f"model_type: {model_type!r} is not supported (expected 'kimi_linear' or 'kimi_k3')"
        )

    # -- writing ---------------------------------------------------------------------------------------
    def to_hf(self) -> dict:
        """The config.json of this model in its checkpoint format (what `from_dict` reads back)."""
        text = self._text_config()
        if self.model_type == "kimi_linear":
            return {"architectures": ["KimiLinearForCausalLM"], **text}
        top = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "text_config": text,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_out(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.experts_mxfp4:
            top["quantization_config"] = mxfp4_quantization_config()
        return top

    def _text_config(self) -> dict:
        kda_layers = [i + 1 for i in self.kda_layer_ids]
        full_layers = [i + 1 for i in self.mla_layer_ids]
        lac: dict[str, Any] = {
            "head_dim": self.kda_head_dim,
            "num_heads": self.kda_num_heads,
            "short_conv_kernel_size": self.kda_conv_size,
            "kda_layers": kda_layers,
            "full_attn_layers": full_layers,
        }
        if self.kda_gate_lower_bound is not None:
            lac["gate_lower_bound"] = self.kda_gate_lower_bound
        if self.kda_full_rank_gate:
            lac["use_full_rank_gate"] = True
        first_dense = next((i for i, t in enumerate(self.mlp_types) if t == MOE), self.num_hidden_layers)
        out: dict[str, Any] = {
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "model_max_length": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_out(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "linear_attn_config": lac,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "first_k_dense_replace": first_dense,
            "mlp_layer_types": ["sparse" if t == MOE else "dense" for t in self.mlp_types],
            "num_nextn_predict_layers": 0,
        }
        if self.hidden_act == "situ":
            out["activation_situ_beta"] = self.situ_beta
            out["activation_situ_linear_beta"] = self.situ_linear_beta
        if self.mla_output_gate:
            out["mla_use_output_gate"] = True
        if self.routed_expert_hidden_size is not None:
            out["routed_expert_hidden_size"] = self.routed_expert_hidden_size
            out["latent_moe_use_norm"] = self.latent_moe_use_norm
        if self.attn_res_block_size is not None:
            out["attn_res_block_size"] = self.attn_res_block_size
        if self.use_dsa:
            out["index_n_heads"] = self.index_n_heads
            out["index_head_dim"] = self.index_head_dim
            out["index_topk"] = self.index_topk
        return out

    def replace(self, **changes) -> ModelConfig:
        """A copy with some fields changed, validated again through the HF round trip."""
        values = asdict(self)
        values.pop("extra")
        values.update(changes)
        return ModelConfig.from_dict(ModelConfig(**values, extra={}).to_hf())


def mxfp4_quantization_config() -> dict:
    """The compressed-tensors block of a K3 checkpoint with MXFP4 routed experts (model-spec 7.2)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "ignore": ["re:.*shared_experts.*"],
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "float"}}},
    }


def _eos_out(ids: tuple[int, ...]):
    return None if not ids else (ids[0] if len(ids) == 1 else list(ids))


# -- parsing --------------------------------------------------------------------------------------------


def _parse_k3(raw: dict) -> ModelConfig:
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
    return _parse_text(text, "kimi_k3", quant=quant, where="text_config.")


def _parse_text(raw: dict, model_type: str, quant: dict | None, where: str) -> ModelConfig:
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
        num_expert_group=r.int("num_expert_group", 1),
        topk_group=r.int("topk_group", 1),
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
    hf = raw.get("layer_types")
    if hf is not None:
        mapping = {"linear_attention": KDA, "full_attention": MLA}
        if (
            not isinstance(hf, list)
            or len(hf) != n
            or any(not isinstance(t, str) or t not in mapping for t in hf)
        ):
            raise ConfigError(f"{where}layer_types: expected {n} entries of linear_attention/full_attention")
        hf_types = [mapping[t] for t in hf]
        if types is not None and hf_types != types:
            raise ConfigError(
                f"{where}layer_types disagrees with linear_attn_config.kda_layers/full_attn_layers"
            )
        types = hf_types
    if types is None:
        raise ConfigError(f"missing config field(s): {where}linear_attn_config.kda_layers, full_attn_layers")
    return tuple(types)  # type: ignore[arg-type]


def _mlp_types(raw: dict, n: int, where: str) -> tuple[str, ...]:
    first = raw.get("first_k_dense_replace")
    freq = raw.get("moe_layer_freq", 1)
    hf = raw.get("mlp_layer_types")
    types = None
    if first is not None:
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigError(f"{where}first_k_dense_replace must be a non-negative integer")
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"{where}moe_layer_freq must be a positive integer")
        types = [MOE if i >= first and i % freq == 0 else DENSE for i in range(n)]
    if hf is not None:
        mapping = {"dense": DENSE, "sparse": MOE}
        if (
            not isinstance(hf, list)
            or len(hf) != n
            or any(not isinstance(t, str) or t not in mapping for t in hf)
        ):
            raise ConfigError(f"{where}mlp_layer_types: expected {n} entries of dense/sparse")
        hf_types = [mapping[t] for t in hf]
        if types is not None and hf_types != types:
            raise ConfigError(f"{where}mlp_layer_types disagrees with first_k_dense_replace/moe_layer_freq")
        types = hf_types
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
        return float(value)

    def opt_float(self, key: str) -> float | None:
        return None if self.raw.get(key) is None else self.float(key)


_NO_DEFAULT = object()


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model: the serving engine's settings (the CLI and `LLM(...)` build one)."""

    model: str = "tiny"  # checkpoint folder or preset name (random weights)
    tokenizer: str | None = (
        None  # folder with tokenizer.json; default: the model folder, else the byte tokenizer
    )
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)
    device: str = "auto"
    seed: int = 0  # random-weight presets
    max_running_requests: int = 64  # = KDA state slots
    page_size: int = 64
    mem_fraction: float = 0.85  # of the GPU memory free after weights and state slots, for KV pages
    kv_cache_bytes: int | None = None  # explicit KV budget (default on CPU: 256 MiB)
    max_model_len: int | None = None  # context limit (default: the model's, capped by the KV pool)
    chunked_prefill_size: int = 2048  # tokens per step (prefill chunks + decode tokens)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    max_queued_requests: int = 4096  # server: past this many waiting requests, answer 503
    enable_prefix_cache: bool = True  # radix tree over KV pages + KDA state checkpoints
    checkpoint_interval: int = (
        1024  # save a KDA checkpoint every this many prefill tokens (multiple of pages)
    )
    num_checkpoints: int | None = None  # checkpoint slots (default: 2 per running request, at least 16)
    # HiCache: what the GPU evicts from the prefix cache goes to host memory, and from there to disk.
    hicache_host_bytes: int = 0  # host tier size (pinned with CUDA); 0 = off
    hicache_disk_dir: str | None = None  # disk tier folder (below the host tier); None = no disk tier
    hicache_disk_bytes: int = 0  # disk tier size cap

    def __post_init__(self):
        problems = []
        if self.max_running_requests < 1:
            problems.append("max_running_requests must be >= 1")
        if self.page_size < 1:
            problems.append("page_size must be >= 1")
        if not 0 < self.mem_fraction <= 1:
            problems.append("mem_fraction must be in (0, 1]")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            problems.append("kv_cache_bytes must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append("max_model_len must be >= 2")
        if self.chunked_prefill_size < 1:
            problems.append("chunked_prefill_size must be >= 1")
        if self.max_queued_requests < 1:
            problems.append("max_queued_requests must be >= 1")
        if self.checkpoint_interval < 0 or (
            self.checkpoint_interval and self.checkpoint_interval % self.page_size
        ):
            problems.append("checkpoint_interval must be a multiple of page_size (0 = off)")
        if self.num_checkpoints is not None and self.num_checkpoints < 1:
            problems.append("num_checkpoints must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype {self.dtype!r} must be auto, float32, bfloat16 or float16")
        if self.hicache_host_bytes < 0 or self.hicache_disk_bytes < 0:
            problems.append("hicache_host_bytes and hicache_disk_bytes must be >= 0")
        if self.hicache_host_bytes and not self.enable_prefix_cache:
            problems.append("the hicache tiers extend the prefix cache: enable_prefix_cache must be on")
        if (self.hicache_disk_dir is None) != (self.hicache_disk_bytes == 0):
            problems.append("hicache_disk_dir and hicache_disk_bytes go together (both set, or neither)")
        if self.hicache_disk_dir is not None and not self.hicache_host_bytes:
            problems.append("the hicache disk tier sits below the host tier: set hicache_host_bytes too")
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass(frozen=True)
class TrainConfig:
    """`kestrel train`: pretraining / SFT of a preset (or a checkpoint) on the procedural task mixture."""

    out_dir: str
    model: str = "demo"  # preset name (random init) or checkpoint folder to continue from
    tokenizer: str | None = (
        None  # folder with tokenizer.json; default: <out_dir>/tokenizer, trained if missing
    )
    seed: int = 0
    steps: int = 1000
    batch_rows: int = 16  # B: rows per step
    row_len: int = 4096  # R: tokens per row (documents never cross rows)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dsa_dense_steps: int = 200  # dense warm-up: attention over all visible tokens, the indexer learns by KL
    indexer_kl_weight: float = 1.0
    bias_update_rate: float = 1e-3  # aux-loss-free MoE balancing: bias += rate * sign(mean load - load)
    checkpoint_every: int = 500
    log_every: int = 10
    time_budget_s: float | None = None  # stop (and checkpoint) after this much training time
    device: str = "auto"
    data_workers: int = 0
    retrieval_lengths: tuple[int, ...] = (
        2048,
    )  # context lengths of the retrieval family's training documents

    def __post_init__(self):
        checks = [
            (self.steps >= 1, "steps must be >= 1"),
            (self.batch_rows >= 1 and self.row_len >= 16, "batch_rows >= 1 and row_len >= 16"),
            (self.lr > 0 and 0 <= self.min_lr_ratio <= 1, "lr > 0 and min_lr_ratio in [0, 1]"),
            (self.warmup_steps >= 0 and self.dsa_dense_steps >= 0, "warmup and dsa_dense steps must be >= 0"),
            (self.grad_clip > 0, "grad_clip must be > 0"),
            (
                self.checkpoint_every >= 1 and self.log_every >= 1,
                "checkpoint_every and log_every must be >= 1",
            ),
            (all(n < self.row_len for n in self.retrieval_lengths), "retrieval_lengths must fit in row_len"),
        ]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ConfigError("; ".join(bad))
