"""`naive.linear_cross_entropy` without the whole logits tensor: a few rows of logits at a time, forward and
backward.

Training `mini` (a 129K vocabulary) on one 8704-token row holds [8704, 129280] logits in bf16, their fp32 copy and
that copy's gradient: 11 GB, and two rows ran out of memory beside the fp32 optimizer state. Here the forward keeps
only each token's log-sum-exp; the backward computes each chunk's logits again, its softmax gradient, and adds
the chunk's share of the gradients of the hidden states and of the weight. The matmuls run in the autocast dtype
where autocast is on (bf16 on the GPU, as the LM head does), the softmax in fp32.

Legend: T tokens, D hidden size, V vocabulary, C rows a chunk.
"""

from __future__ import annotations

import torch


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows: int, dtype: torch.dtype):
        h, w = hidden.to(dtype), weight.to(dtype)
        losses = torch.empty(h.shape[0], device=h.device, dtype=torch.float32)
        lse = torch.empty_like(losses)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                logits = (h[s : s + rows] @ w.t()).float()  # [C, V]
                lse[s : s + rows] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, targets[s : s + rows, None])[:, 0]
                losses[s : s + rows] = lse[s : s + rows] - picked
        ctx.save_for_backward(h, w, targets, lse)
        ctx.rows, ctx.dtypes = rows, (hidden.dtype, weight.dtype)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        h, w, targets, lse = ctx.saved_tensors
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], ctx.rows):
                hc = h[s : s + ctx.rows]
                logits = (hc @ w.t()).float()
                g = torch.exp(logits - lse[s : s + ctx.rows, None])  # softmax [C, V]
                g.scatter_add_(1, targets[s : s + ctx.rows, None], torch.full_like(g[:, :1], -1.0))
                g = (g * grad_losses[s : s + ctx.rows, None].float()).to(h.dtype)
                grad_h[s : s + ctx.rows] = g @ w
                grad_w += (g.t() @ hc).float()
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int
) -> torch.Tensor:
    """Per-token loss [T] fp32, as `naive.linear_cross_entropy`, `rows` tokens' logits at a time."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, rows, _compute_dtype(hidden))
