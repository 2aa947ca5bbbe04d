"""Build a model: random weights from a config (presets, tests, `init-random`) or weights from a checkpoint."""

from __future__ import annotations

import contextlib
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
from kestrel.presets import INIT_SCHEMES, PRESETS, preset_config, resolve_model
from kestrel.utils.errors import CheckpointError, ConfigError

# Parameters that write into the residual stream: scaled by 1 / sqrt(2 * layers) by the "conditioned" init.
RESIDUAL_OUTPUTS = (
    "self_attn.o_proj.weight",
    "mlp.experts.w2",
    "mlp.shared_experts.down_proj.weight",
    "mlp.down_proj.weight",
    "mlp.routed_expert_up_proj.weight",
)


@torch.no_grad()
def init_random_weights(
    model: KimiForCausalLM,
    seed: int = 0,
    std: float = 0.02,
    rng_device: str | torch.device = "cpu",
    scheme: str = "upstream",
) -> KimiForCausalLM:
    """Deterministic random weights in the spirit of fla/transformers init: normal(0, std) matrices, unit norms,
    zero AttnRes queries, KDA A_log = log U(1, 16) and dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1].

    scheme "upstream" (the default; what training starts from) stops there. "conditioned" rescales the same
    draws: the embedding x10 (std 0.2) and the residual-output projections (RESIDUAL_OUTPUTS) by
    1 / sqrt(2 * layers). Upstream's embedding (std 0.02) is a tenth of what each sublayer adds to the stream,
    so the first block's output is nearly the whole stream and its rounding is amplified by every later
    layer: on mini (24 layers) a 1e-3 change of layer 0's attention output moves the logits 25x as much, and
    bf16 alone moves them 12% from fp32, against 0.6-0.9% on the trained demo model. Conditioned: about 1.5%.

    The draws come from a generator on `rng_device`: the CPU (default) gives the same weights on every
    machine; the model's own GPU is much faster for billion-parameter benchmark models."""
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"init scheme {scheme!r}: expected one of {', '.join(INIT_SCHEMES)}")
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
    if scheme == "conditioned":
        if not model.config.tie_word_embeddings:  # tied, the lm_head's logits would grow x10 with it
            model.model.embed_tokens.weight.mul_(10.0)
        residual = (2 * model.config.num_hidden_layers) ** -0.5
        for name, param in model.named_parameters():
            if name.endswith(RESIDUAL_OUTPUTS):
                param.mul_(residual)
    return model


def _initialized(name: str) -> bool:
    return name.endswith(("res_proj.weight", "embed_tokens.weight", "mlp.gate.weight"))


def build_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init_on_device: bool | None = None,
    init: str = "upstream",
) -> KimiForCausalLM:
    """A preset name (random weights, seeded; `init` the scheme of `init_random_weights`) or a checkpoint
    folder (config.json + safetensors).

    Random weights are drawn on `device` when `init_on_device` (default: on CUDA, where billions of CPU draws
    would take a minute); the same seed then gives the same weights on every GPU, and others on the CPU."""
    model = resolve_model(model)
    config = model_config(model)
    if _is_preset(model):
        with _fits(model, device), torch.device(device):
            if init_on_device is None:
                init_on_device = torch.device(device).type == "cuda"
            rng = device if init_on_device else "cpu"
            net = init_random_weights(KimiForCausalLM(config, dtype), seed, rng_device=rng, scheme=init)
            return net.to(device)
    with _fits(model, device, "; are config.json's sizes right?"):
        with torch.device(device):
            net = KimiForCausalLM(config, dtype)  # uninitialized storage: the loader fills every parameter
        load_weights(net, model)
    return net


def model_config(model: str) -> ModelConfig:
    """The config of what `build_model(model)` builds, read without building it (a preset's, or a checkpoint
    folder's config.json)."""
    model = resolve_model(model)
    if _is_preset(model):
        return preset_config(model)
    path = Path(model)
    if not path.exists():
        raise CheckpointError(
            f"model {model!r}: no such checkpoint folder (or preset: {', '.join(sorted(PRESETS))})"
        )
    if not path.is_dir():
        raise CheckpointError(f"model {model!r}: expected a checkpoint folder, got a file")
    with _fits(model, "cpu", "; are config.json's sizes right?"):  # sizes past memory fail even in parsing
        return ModelConfig.from_hf(path)


def _is_preset(model: str) -> bool:
    return model in PRESETS and not Path(model).exists()  # a folder of a preset's name is a checkpoint


@contextlib.contextmanager
def _fits(model: str, device: torch.device | str, hint: str = ""):
    """The model built: one that does not fit the device's memory (a preset too large for it, or a damaged
    config.json's sizes) is a ConfigError naming it, not the allocator's traceback."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch's OutOfMemoryError is a RuntimeError
        text = str(e).strip()
        if not isinstance(e, MemoryError) and "alloc" not in text.lower():
            raise
        detail = f" ({text.splitlines()[0][:200]})" if text else ""
        where = torch.device(device).type.upper()
        raise ConfigError(f"model {model!r} does not fit the {where} memory{detail}{hint}") from None
