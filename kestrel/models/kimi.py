"""The Kimi hybrid model, declared from its config: KDA | gated MLA (+DSA) token mixers, dense | MoE MLPs,
and either a pre-norm residual stream or AttnRes block mixing (model-spec 4-5).

No scheduling, allocation or graph code here: per-batch layout and caches arrive through the
ForwardContext (kestrel.layers.context). Inputs are packed varlen token ids [T].
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import KDA, MOE, ModelConfig
from kestrel.layers.attnres import ResProj, mix_norm, mix_norm_bank
from kestrel.layers.context import ForwardContext, forward_context, has_forward_context
from kestrel.layers.kda import KimiDeltaAttention
from kestrel.layers.linear import Linear, set_loader
from kestrel.layers.mla import MLAttention
from kestrel.layers.moe import DenseMLP, MoE
from kestrel.layers.norm import RMSNorm
from kestrel.ops.attnres import Bank


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        kda = config.layer_types[layer_id] == KDA
        self.self_attn = (
            KimiDeltaAttention(config, layer_id, dtype) if kda else MLAttention(config, layer_id, dtype)
        )
        moe = config.mlp_types[layer_id] == MOE
        self.mlp = MoE(config, layer_id, dtype) if moe else DenseMLP(config, config.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(D, eps, dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype)
        if config.attn_res_block_size is not None:
            self.self_attention_res_proj, self.self_attention_res_norm = (
                ResProj(D, dtype),
                RMSNorm(D, eps, dtype),
            )
            self.mlp_res_proj, self.mlp_res_norm = ResProj(D, dtype), RMSNorm(D, eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm residual form: x + attn(norm(x)), then + mlp(norm(.))."""
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D, dtype=dtype)
        set_loader(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps, dtype)
        if config.attn_res_block_size is not None:
            self.output_attn_res_proj = ResProj(D, dtype)
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> final normed hidden [T, D]
        x = self.embed_tokens(input_ids)
        if self.config.attn_res_block_size is None:
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)
        return self._forward_attn_res(x)

    def _forward_attn_res(self, x0: torch.Tensor) -> torch.Tensor:
        """K3 block schedule (model-spec 4.2): a bank of completed block sums, plus the running partial sum.
        A layer whose index is a multiple of the block size closes the previous block into the bank.
        With autograd on, the bank is a `Bank` (its entries in one buffer, their gradients added up in another)
        and the partial sum a tensor autograd follows; at inference both live in one buffer."""
        if not torch.is_grad_enabled():
            return self._forward_attn_res_buffer(x0)
        block = self.config.attn_res_block_size
        kind = x0.device.type
        if torch.is_autocast_enabled(kind):
            # the bank in one dtype, as at inference (bf16 weights give a bf16 embedding): the layers' outputs come
            # in the autocast dtype, and an fp32 x0 would make the bank, and its gradients, fp32
            # (x0 is only ever a source: the partial sums start from the first layer's output)
            x0 = x0.to(torch.get_autocast_dtype(kind))
        bank = Bank(x0, self._bank_blocks())
        partial = x0
        for i, layer in enumerate(self.layers):
            closes = i % block == 0  # the partial sum closes into the bank
            if closes:
                bank.close(partial)
            h = mix_norm_bank(
                bank,
                None if closes else partial,
                layer.self_attention_res_proj,
                layer.self_attention_res_norm,
                layer.input_layernorm,
            )
            a = layer.self_attn(h)
            partial = a if closes else partial + a
            h = mix_norm_bank(
                bank, partial, layer.mlp_res_proj, layer.mlp_res_norm, layer.post_attention_layernorm
            )
            partial = partial + layer.mlp(h)
        return mix_norm_bank(bank, partial, self.output_attn_res_proj, self.output_attn_res_norm, self.norm)

    def _bank_blocks(self) -> int:
        """Entries of the AttnRes bank: one a block (x0 is the first)."""
        return -(-len(self.layers) // self.config.attn_res_block_size)

    def _forward_attn_res_buffer(self, x0: torch.Tensor) -> torch.Tensor:
        """`_forward_attn_res` at inference, bit for bit: the bank and the partial sum live in one buffer
        [blocks + 1, T, D] (bank = buf[:nb], partial = buf[nb], updated in place), so every mix reads a view of
        it instead of stacking copies of its sources (at 32K tokens on mini the stacks copied ~26 GB a step; in
        decode they were 48 launches a step)."""
        block = self.config.attn_res_block_size
        buf = x0.new_empty(self._bank_blocks() + 1, *x0.shape)  # [blocks + 1, T, D]
        buf[0].copy_(x0)  # the partial sum before the first layer: x0
        nb = 0  # completed block sums: buf[:nb]; the partial sum: buf[nb]
        for i, layer in enumerate(self.layers):
            closes = i % block == 0  # the partial sum closes into the bank
            nb += closes
            sources = buf[:nb] if closes else buf[: nb + 1]
            h = mix_norm(
                sources, layer.self_attention_res_proj, layer.self_attention_res_norm, layer.input_layernorm
            )
            a = layer.self_attn(h)
            # buf[nb] = a (a new partial sum) or += a, inside the mix that reads it
            h = mix_norm(
                buf[: nb + 1],
                layer.mlp_res_proj,
                layer.mlp_res_norm,
                layer.post_attention_layernorm,
                update=a,
                accumulate=not closes,
            )
            # buf[nb] += the block's output (inside the MoE's last kernel, or add_)
            layer.mlp(h, add_to=buf[nb])
        return mix_norm(buf[: nb + 1], self.output_attn_res_proj, self.output_attn_res_norm, self.norm)


class KimiForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.model = KimiModel(config, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] packed -> logits [T, V] (or [len(logits_indices), V]).

        Runs inside the active ForwardContext; without one, `input_ids` is one sequence with no cache.
        """
        if not has_forward_context():
            with forward_context(ForwardContext.build([input_ids.shape[0]], device=input_ids.device)):
                return self.forward(input_ids, logits_indices)
        h = self.model(input_ids)  # [T, D]
        if logits_indices is not None:
            h = h[logits_indices]
        return self.lm_head(h)
