"""The training objective's token-level parts: the weighted mean cross-entropy over the loss mask, and the plain
mean loss of each task family that the loop logs beside it (sums and counts, so that a step of several batches
adds them up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted mean cross-entropy. logits [T, V], targets [T], weight [T]: 0 off the loss mask, else the
    token's weight (a bool mask gives the plain mean over the masked positions). With family loss weights
    (--retrieval-loss-weight) the logged `loss` is this weighted mean, not comparable with unweighted runs'."""
    return _weighted_mean(F.cross_entropy(logits.float(), targets, reduction="none"), weight)


def _weighted_mean(losses: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    weight = weight.to(losses.dtype)
    return (losses * weight).sum() / loss_weight_total([weight])


def loss_weight_total(weights: list[torch.Tensor]) -> torch.Tensor:
    """The loss weight of all of a step's batches (each [T]), kept off zero: the weighted mean's denominator."""
    total = weights[0].sum()
    for w in weights[1:]:  # a step of one batch (the usual) adds nothing
        total = total + w.sum()
    return total.clamp(min=1e-6)


def family_loss_sums(
    losses: torch.Tensor, mask: torch.Tensor, family_ids: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per family (family_ids [T], -1 for none): the sum of the token losses [T] on the loss mask [T] and the count
    of loss tokens ([n] each), which add up over the batches of a step; sums / counts is each family's plain mean
    loss (0 / 0 = NaN for a family without loss tokens). On the device, without a sync."""
    keep = mask & (family_ids >= 0)
    ids = family_ids.clamp(min=0)
    sums = losses.new_zeros(n).index_add_(0, ids, torch.where(keep, losses, 0.0))
    counts = losses.new_zeros(n).index_add_(0, ids, keep.to(losses.dtype))
    return sums, counts
