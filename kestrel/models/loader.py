"""Build a model: random weights from a config (presets, tests, `init-random`) or weights from a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.layers.attnres import ResProj
from kestrel.layers.kda import KimiDeltaAttention
from kestrel.layers.moe import Experts, Router
from kestrel.layers.norm import LayerNorm, RMSNorm
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.weights import load_weights
from kestrel.presets import PRESETS, preset_config, resolve_model
from kestrel.utils.errors import CheckpointError


@torch.no_grad()
def init_random_weights(
    model: KimiForCausalLM, seed: int = 0, std: float = 0.02, rng_device: str | torch.device = "cpu"
) -> KimiForCausalLM:
    """Deterministic random weights in the spirit of fla/transformers init: normal(0, std) matrices, unit norms,
    zero AttnRes queries, KDA A_log = log U(1, 16) and dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1].

    The draws come from a generator on `rng_device`: the CPU (default) gives the same weights on every
    machine; the model's own GPU is much faster for billion-parameter benchmark models."""
    g = torch.Generator(rng_device).manual_seed(seed)

    def normal_(t: torch.Tensor, scale: float = std):
        t.copy_(torch.randn(t.shape, generator=g, device=g.device) * scale)

    for module in model.modules():
        if isinstance(module, (RMSNorm, LayerNorm)):
            module.weight.fill_(1.0)
            if isinstance(module, LayerNorm):
                module.bias.zero_()
        elif isinstance(module, ResProj):
            module.weight.zero_()
        elif isinstance(module, KimiDeltaAttention):
            module.A_log.copy_(
                torch.empty(module.A_log.shape, device=g.device).uniform_(1, 16, generator=g).log()
            )
            dt = (
                torch.empty(module.dt_bias.shape, device=g.device)
                .uniform_(math.log(1e-3), math.log(1e-1), generator=g)
                .exp()
            )
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            bound = module.conv_size**-0.5
            module.conv_weight.copy_(
                torch.empty(module.conv_weight.shape, device=g.device).uniform_(-bound, bound, generator=g)
            )
        elif isinstance(module, Router):
            normal_(module.weight)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, Experts):
            normal_(module.w13)
            normal_(module.w2)
        elif isinstance(module, (nn.Embedding,)):
            normal_(module.weight)
    for name, param in model.named_parameters():
        if name.endswith(".weight") and param.dim() == 2 and not _initialized(name):
            normal_(param)
    return model


def _initialized(name: str) -> bool:
    return name.endswith(("res_proj.weight", "embed_tokens.weight", "mlp.gate.weight"))


def build_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init_on_device: bool | None = None,
) -> KimiForCausalLM:
    """A preset name (random weights, seeded) or a checkpoint folder (config.json + safetensors).

    Random weights are drawn on `device` when `init_on_device` (default: on CUDA, where billions of CPU draws
    would take a minute); the same seed then gives the same weights on every GPU, and others on the CPU."""
    model = resolve_model(model)
    path = Path(model)
    if not path.exists() and model in PRESETS:
        config = preset_config(model)
        with torch.device(device):
            if init_on_device is None:
                init_on_device = torch.device(device).type == "cuda"
            rng = device if init_on_device else "cpu"
            return init_random_weights(KimiForCausalLM(config, dtype), seed, rng_device=rng).to(device)
    if not path.exists():
        raise CheckpointError(
            f"model {model!r}: no such checkpoint folder (or preset: {', '.join(sorted(PRESETS))})"
        )
    if not path.is_dir():
        raise CheckpointError(f"model {model!r}: expected a checkpoint folder, got a file")
    config = ModelConfig.from_hf(path)
    with torch.device(device):
        net = KimiForCausalLM(config, dtype)  # uninitialized storage: the loader fills every parameter
    load_weights(net, path)
    return net
