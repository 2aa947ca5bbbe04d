"""Built-in model shapes, as HF config dicts that go through the one config path (`ModelConfig.from_dict`).

- `tiny`: CPU tests. Every feature on: KDA with the K3 lower-bound gate and full-rank output gate, gated MLA
  with q-LoRA and a DSA indexer (small top-k, so selection is really sparse), a dense first layer, grouped
  MoE routing with shared experts, latent MoE, SiTU, and AttnRes with several blocks.
- `mini`: benchmark scale on one H200 (about 3B total / 0.5B active; 24 layers = 18 KDA + 6 DSA), sized as
  the E1 model of `shared/reference/performance.md` section 6, with the K3 features on.

- `demo`: the shipped demo model's shape (18 M parameters, `LLLSLLLS`); `demo-attn4` the same with 4 of its 8
  layers MLA + DSA (`LSLSLSLS`), untrained, for issue 5's retrieval experiment.

The trained demo model (issue 5) ships as a checkpoint folder inside the package, named `kestrel-demo`
(kestrel/data/kestrel-demo); `builtin_model()` is it when installed, else `tiny`, and `resolve_model()` turns
that name into the folder.

`fmt="kimi_linear"` gives the variant that transformers' `KimiLinearForCausalLM` loads: no DSA and no
K3-only features (softplus gate, low-rank output gate, no MLA gate, SwiGLU, no latent MoE, no AttnRes).
"""

from __future__ import annotations

from pathlib import Path

from kestrel.config import ModelConfig
from kestrel.utils.errors import CheckpointError, ConfigError

# The random-weight schemes of a preset (kestrel.models.loader.init_random_weights): "upstream" is normal(0.02) as
# transformers and fla; "conditioned" rescales the same draws for a small bf16 floor.
INIT_SCHEMES = ("upstream", "conditioned")

# The byte tokenizer's ids (kestrel.tokenizer.ByteTokenizer): 256 bytes, then specials.
_BYTE_VOCAB, _BYTE_BOS, _BYTE_EOS, _BYTE_PAD, _BYTE_IM_END = 261, 256, 257, 258, 260

_TINY = {
    "model_type": "kimi_linear",
    "vocab_size": _BYTE_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "model_max_length": 4096,
    "bos_token_id": _BYTE_BOS,
    "eos_token_id": [_BYTE_EOS, _BYTE_IM_END],
    "pad_token_id": _BYTE_PAD,
    "linear_attn_config": {
        "head_dim": 16,
        "num_heads": 2,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4, 5],
        "full_attn_layers": [3, 6],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "num_attention_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 96,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 32,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "moe_renormalize": True,
    "num_expert_group": 2,
    "topk_group": 1,
    "routed_expert_hidden_size": 48,
    "latent_moe_use_norm": True,
    "attn_res_block_size": 2,
}

_MINI = {
    "model_type": "kimi_linear",
    "vocab_size": 129280,
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "model_max_length": 131072,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "linear_attn_config": {
        "head_dim": 128,
        "num_heads": 8,
        "short_conv_kernel_size": 4,
        "kda_layers": [i for i in range(1, 25) if i % 4],
        "full_attn_layers": [4, 8, 12, 16, 20, 24],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "num_attention_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 2048,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 5632,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "num_experts": 64,
    "num_experts_per_token": 6,
    "moe_intermediate_size": 256,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "moe_renormalize": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "attn_res_block_size": 6,
}

# The shipped demo model (issue 5): trained by `kestrel train` on procedural reasoning and long-context
# retrieval. ~18M parameters (35 MiB in bf16), every K3.1 feature on, DSA top-256 so that 2K+ is really sparse.
_DEMO = {
    "model_type": "kimi_linear",
    "vocab_size": 5120,
    "hidden_size": 384,
    "num_hidden_layers": 8,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "model_max_length": 32768 + 1024,
    "bos_token_id": 0,
    "eos_token_id": [1, 4],
    "pad_token_id": 2,
    "linear_attn_config": {
        "head_dim": 64,
        "num_heads": 6,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
    "num_attention_heads": 6,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 256,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 96,
    "num_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "moe_renormalize": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "attn_res_block_size": 4,
}

# The demo with half its layers MLA + DSA (`LSLSLSLS`, 4 of 8, against the demo's 2), for the retrieval
# experiment of issue 5: the demo model copies a code's digits past its first by local induction, steered by
# no name (session 11's name_swap diagnosis); more attention layers are one way to give it the capacity.
# Untrained: `kestrel train --model demo-attn4` starts it from random weights.
_DEMO_ATTN4 = {
    **_DEMO,
    "linear_attn_config": {
        **_DEMO["linear_attn_config"],
        "kda_layers": [1, 3, 5, 7],
        "full_attn_layers": [2, 4, 6, 8],
    },
}

PRESETS = {"tiny": _TINY, "mini": _MINI, "demo": _DEMO, "demo-attn4": _DEMO_ATTN4}
_K3_ONLY = (
    "mla_use_output_gate",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "attn_res_block_size",
)


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_hf_config(name: str, fmt: str = "kimi_k3") -> dict:
    """The config.json dict of a preset in checkpoint format `fmt` ('kimi_k3' or 'kimi_linear')."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (choose from {', '.join(preset_names())})")
    text = {k: (list(v) if isinstance(v, list) else v) for k, v in PRESETS[name].items()}
    text["linear_attn_config"] = dict(text["linear_attn_config"])
    if fmt == "kimi_linear":
        for key in _K3_ONLY:
            text.pop(key, None)
        text["hidden_act"] = "silu"
        text["linear_attn_config"].pop("gate_lower_bound", None)
        text["linear_attn_config"].pop("use_full_rank_gate", None)
        # MLA: one KV head per query head. Said explicitly: transformers' KimiLinearConfig defaults it to 32,
        # and Kestrel refuses a checkpoint whose config says so
        text["num_key_value_heads"] = text["num_attention_heads"]
        return text
    if fmt == "kimi_k3":
        return ModelConfig.from_dict(text).replace(model_type="kimi_k3").to_hf()
    raise ConfigError(f"unknown checkpoint format {fmt!r} (choose kimi_k3 or kimi_linear)")


def preset_config(name: str, fmt: str = "kimi_k3") -> ModelConfig:
    return ModelConfig.from_dict(preset_hf_config(name, fmt))


SHIPPED_MODEL = "kestrel-demo"


def shipped_model_dir() -> Path | None:
    """The folder of the trained demo checkpoint shipped in the package, or None when it is not there."""
    path = Path(__file__).resolve().parent / "data" / SHIPPED_MODEL
    return path if (path / "config.json").is_file() else None


def builtin_model() -> str:
    """The model `serve`, `generate` and `chat` use without --model: the shipped demo model, else `tiny`."""
    return SHIPPED_MODEL if shipped_model_dir() is not None else "tiny"


def resolve_model(model: str) -> str:
    """A --model argument as a checkpoint folder or a preset name: `kestrel-demo` (unless a folder of that name
    exists here) is the shipped checkpoint's folder."""
    if model != SHIPPED_MODEL or Path(model).exists():
        return model
    path = shipped_model_dir()
    if path is None:
        raise CheckpointError(
            f"model {SHIPPED_MODEL!r} is not in this install (no kestrel/data/{SHIPPED_MODEL}/config.json); "
            f"give a checkpoint folder or a preset ({', '.join(preset_names())})"
        )
    return str(path)
