"""The language-model loss from the last hidden states, as written: logits, then per-token cross-entropy.

Legend: T tokens, D hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss [T] fp32 of the logits hidden [T, D] @ weight [V, D].T against targets [T] (under autocast
    the matmul runs in its dtype, as the LM head does; the loss in fp32)."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none")
