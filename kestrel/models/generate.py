"""The slow reference `generate()`: one request, dense cache, token by token. It is the oracle the engine is
tested against (same tokens at temperature 0; same tokens for the same seed)."""

from __future__ import annotations

import torch

from kestrel.layers.context import forward_context
from kestrel.models.cache import DenseCache
from kestrel.models.kimi import KimiForCausalLM
from kestrel.ops.sampling.naive import greedy, process_logits, sample


@torch.no_grad()
def generate(
    model: KimiForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    prefill_chunk: int | None = None,
) -> list[int]:
    """Greedy (temperature 0) or seeded sampling. The prompt is prefilled in chunks of `prefill_chunk` tokens
    (one chunk when None); generation stops after `max_new_tokens` or at an EOS id (which is returned)."""
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    cache = DenseCache(model.config, 1, len(prompt_ids) + max_new_tokens, dtype, device)
    chunk = prefill_chunk or len(prompt_ids)
    pieces = [prompt_ids[i : i + chunk] for i in range(0, len(prompt_ids), chunk)]
    out: list[int] = []
    for step in range(max_new_tokens + len(pieces) - 1):
        ids = pieces[step] if step < len(pieces) else [out[-1]]
        ctx = cache.context([0], [len(ids)], device)
        with forward_context(ctx):
            logits = model(torch.tensor(ids, device=device), logits_indices=torch.tensor([len(ids) - 1]))[0]
        cache.commit(ctx)
        if step < len(pieces) - 1:
            continue  # more prompt to prefill
        if temperature == 0:
            token = int(greedy(logits))
        else:
            row = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt, device=device)  # noqa: E731
            probs = process_logits(
                logits[None], row(temperature), row(top_k, torch.int64), row(top_p), row(min_p)
            )
            token = int(sample(probs, row(seed, torch.int64), row(len(out), torch.int64))[0])
        out.append(token)
        if token in eos_token_ids:
            break
    return out
