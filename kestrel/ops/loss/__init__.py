"""The LM loss from the last hidden states: the plain form, or chunked over tokens where the logits would be
large (`CHUNK_ABOVE` elements; `mini`'s 129K vocabulary over one 8704-token row is past it, the demo model's
5K vocabulary over its batches is not)."""

from __future__ import annotations

import torch

from kestrel.ops.loss.chunked import chunked_linear_cross_entropy, chunked_weighted_cross_entropy
from kestrel.ops.loss.naive import linear_cross_entropy

CHUNK_ABOVE = 2**30  # logits elements: 4 GiB in fp32
CHUNK_ELEMENTS = 2**27  # a chunk's logits: 512 MiB in fp32


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [T] fp32 of hidden [T, D] through the LM head weight [V, D] against targets [T]."""
    rows = _chunk_rows(hidden, weight)
    if rows is None:
        return linear_cross_entropy(hidden, weight, targets)
    return chunked_linear_cross_entropy(hidden, weight, targets, rows)


def weighted_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_losses` for a loss that is their weighted sum: (sum(losses * token_weights), 0-dim fp32 with
    autograd; the per-token losses [T] fp32, without autograd). token_weights [T] (0 off the loss mask) are
    constants, with no gradient: so the gradient of each token's logits, token_weights * (softmax - one_hot), is
    known in the forward, and where the logits are chunked the forward computes the gradients of the hidden states
    and of the weight with it, sparing the backward a second pass over the logits (and their matmul)."""
    rows = _chunk_rows(hidden, weight)
    if rows is None:
        losses = linear_cross_entropy(hidden, weight, targets)
        return (losses * token_weights.detach().float()).sum(), losses.detach()
    return chunked_weighted_cross_entropy(hidden, weight, targets, token_weights, rows)


def _chunk_rows(hidden: torch.Tensor, weight: torch.Tensor) -> int | None:
    """Tokens a chunk where the [T, V] logits would pass CHUNK_ABOVE elements; None: the plain form."""
    T, V = hidden.shape[0], weight.shape[0]
    return None if T * V <= CHUNK_ABOVE else max(1, CHUNK_ELEMENTS // V)


__all__ = [
    "CHUNK_ABOVE",
    "chunked_linear_cross_entropy",
    "chunked_weighted_cross_entropy",
    "linear_cross_entropy",
    "token_losses",
    "weighted_token_losses",
]
