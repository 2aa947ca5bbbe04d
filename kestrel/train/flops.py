"""What a training step costs in FLOPs: the count the MFU uses (`flops_per_token`), and the attention accounting
beside it (the pairs each packed document's own causal attention needs)."""

from __future__ import annotations

from kestrel.models.kimi import KimiForCausalLM


def flops_per_token(model: KimiForCausalLM, row_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (routed experts counted at top-k, the embedding
    lookup not at all) plus attention: 6 x (QK^T + PV) over an average causal context of row_len / 2."""
    c = model.config
    active = 0
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" or p.dim() < 2:
            continue
        if ".experts." in name:
            active += p.numel() * c.num_experts_per_token / c.num_experts
        else:
            active += p.numel()
    return 6 * active + attention_flops_per_pair(model) * row_len / 2


def attention_flops_per_pair(model: KimiForCausalLM) -> float:
    """Training FLOPs of one visible (query, key) pair, summed over the MLA layers: `flops_per_token` counts
    row_len / 2 such pairs a token."""
    c = model.config
    return 6 * len(c.mla_layer_ids) * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)


def visible_pairs_per_token(seqlens: list[int], topk: int | None = None) -> float:
    """The mean number of keys a token's query sees when each packed document is causal on its own (what a
    kernel that skips other documents' keys computes; `flops_per_token` counts the whole row's causal half),
    with `topk` at most that many (DSA sparse training)."""
    pairs = 0
    for n in seqlens:
        full = n if topk is None else min(n, topk)  # queries up to `full` see all their causal past
        pairs += full * (full + 1) // 2 + (n - full) * (topk or 0)
    return pairs / max(sum(seqlens), 1)
