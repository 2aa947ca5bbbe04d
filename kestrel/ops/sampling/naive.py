"""Sampling reference: logits processing and seeded sampling that does not depend on the batch.

A request with seed s draws its token at output step j from `noise(s, j)`, a vector of Exp(1) variates from a
generator seeded by (s, j) alone; the token is argmax(p / noise) (the exponential race, an exact sample of p).
So the same seed gives the same tokens whatever else is in the batch, on any engine path that uses this noise.
"""

from __future__ import annotations

import torch

_SEED_STRIDE = 1_000_003


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """logits [V] or [B, V] -> probabilities (fp32) after temperature, top-k, top-p and min-p filtering.

    top_k <= 0 and top_p >= 1 and min_p <= 0 disable their filter. temperature must be > 0 here.
    """
    if temperature <= 0:
        raise ValueError("process_logits needs temperature > 0 (temperature 0 is greedy argmax)")
    x = logits.float() / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [.., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def noise(seed: int, step: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise [V] of request seed `seed` at output step `step` (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed((seed * _SEED_STRIDE + step) % (2**63))
    return torch.empty(vocab).exponential_(generator=g).to(device)


def sample(probs: torch.Tensor, seed: int, step: int) -> int:
    """One token from probs [V] with the request's (seed, step) noise."""
    return int(torch.argmax(probs / noise(seed, step, probs.shape[-1], probs.device)))


def greedy(logits: torch.Tensor) -> int:
    """argmax; ties go to the lowest token id."""
    return int(torch.argmax(logits))
