"""`ModelConfig`: everything the model math needs, validated, built once from a checkpoint's config.json.

Layers never read HF config objects. Two checkpoint formats are understood (model-spec section 8):
`kimi_linear` (flat; Moonshot's original keys or what transformers writes) and `kimi_k3` (the text model
nested under `text_config`). The DSA fields `index_n_heads`, `index_head_dim`, `index_topk` put a lightning
indexer on every full-attention layer. A missing, unknown or inconsistent field raises `ConfigError` naming it.
The parsing itself lives in `kestrel.config.hf`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kestrel.utils.errors import ConfigError

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"


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
    num_expert_group: int  # 1: plain top-k over every expert (also what use_grouped_topk false gives)
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
            # `kestrel train --out`'s folder given for its checkpoint
            run = path / "checkpoint" / "config.json"
            hint = f" (a training run's folder? its checkpoint is {run.parent})" if run.is_file() else ""
            raise ConfigError(f"no config.json at {file}{hint}")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: expected a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        from kestrel.config.hf import parse_k3_config, parse_text_config  # builds ModelConfig: imported late

        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            return parse_k3_config(raw)
        if model_type == "kimi_linear":
            return parse_text_config(raw, "kimi_linear", quant=raw.get("quantization_config"), where="")
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
