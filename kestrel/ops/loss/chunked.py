"""`naive.linear_cross_entropy` without the whole logits tensor: a few rows of logits at a time, forward and
backward.

Training `mini` (a 129K vocabulary) on one 8704-token row holds [8704, 129280] logits in bf16, their fp32 copy and
that copy's gradient: 11 GB, and two rows ran out of memory beside the fp32 optimizer state. Here the forward keeps
only each token's log-sum-exp; the backward computes each chunk's logits again, its softmax gradient, and adds
the chunk's share of the gradients of the hidden states and of the weight. The matmuls run in the autocast dtype
where autocast is on (bf16 on the GPU, as the LM head does), the softmax in fp32.

Where the loss is a weighted sum of the token losses with weights known before the forward (training's), the
gradient of each chunk's logits is known as soon as its softmax is: `chunked_weighted_cross_entropy` computes the
gradients of the hidden states and of the weight in the forward, chunk by chunk, and its backward only scales them.
Three matmuls a chunk instead of four, and no logits computed twice.

On CUDA each chunk's softmax work is one compiled kernel reading the bf16 logits (the log-sum-exp and the target's
logit; the gradient; or all three at once), with no fp32 copy of them, and the weight's gradient accumulates in
fp32 inside the matmul (cuBLAS with beta = 1): the eager form spent 65 of its 115 ms a step on `mini` at two rows
in those copies and additions (session 27's profile).

Legend: T tokens, D hidden size, V vocabulary, C rows a chunk.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from kestrel.utils.fuse import for_training


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _lse_and_target(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [C, V], targets [C] -> (log-sum-exp [C], the target's logit [C]), fp32."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1), x.gather(1, targets[:, None])[:, 0]


def _softmax_grad(
    logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """d loss / d logits [C, V] in logits' dtype: (softmax - one_hot(targets)) * grad (the upstream gradient of
    each token's loss [C]), computed in fp32."""
    g = torch.exp(logits.float() - lse[:, None])
    cols = torch.arange(logits.shape[1], device=logits.device)
    g = torch.where(cols[None, :] == targets[:, None], g - 1.0, g)
    return (g * grad[:, None].float()).to(logits.dtype)


def _lse_target_and_grad(
    logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_lse_and_target` and `_softmax_grad` of one chunk together (one kernel when compiled): log-sum-exp [C] and
    the target's logit [C] in fp32, d loss / d logits [C, V] in logits' dtype for the token weights `grad` [C]."""
    lse, picked = _lse_and_target(logits, targets)
    return lse, picked, _softmax_grad(logits, lse, targets, grad)


def _run(fn, *args):
    """A chunk function as training runs it (`for_training`: compiled on CUDA unless KESTREL_COMPILE_TRAIN is off):
    one kernel over the chunk, one graph per chunk length (a training run has two: its rows, and the last chunk's
    remainder)."""
    return for_training(fn, args[0])(*args)


@functools.cache
def fp32_accumulate_works() -> bool:
    """Whether this torch's addmm, on CUDA, adds a bf16 product into an fp32 tensor in place (probed once, its
    values checked)."""
    try:
        c = torch.ones(4, 8, device="cuda")
        a, b = (torch.ones(shape, device="cuda", dtype=torch.bfloat16) for shape in ((4, 16), (16, 8)))
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        return bool((c == 17).all())
    except (RuntimeError, TypeError):
        return False


def _accumulate(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w [V, D] fp32 += g.T @ h (g [C, V], h [C, D]): in one cuBLAS call with fp32 output where torch has
    it (CUDA, bf16 or fp16 inputs), else a product then an addition."""
    if grad_w.is_cuda and g.dtype != grad_w.dtype and fp32_accumulate_works():
        torch.addmm(grad_w, g.t(), h, out_dtype=grad_w.dtype, out=grad_w)
    else:
        grad_w += (g.t() @ h).float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows: int, dtype: torch.dtype):
        h, w = hidden.to(dtype), weight.to(dtype)
        losses = torch.empty(h.shape[0], device=h.device, dtype=torch.float32)
        lse = torch.empty_like(losses)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                lse_c, picked = _run(_lse_and_target, h[s : s + rows] @ w.t(), targets[s : s + rows])
                lse[s : s + rows] = lse_c
                losses[s : s + rows] = lse_c - picked
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
                e = s + ctx.rows
                hc = h[s:e]
                g = _run(_softmax_grad, hc @ w.t(), lse[s:e], targets[s:e], grad_losses[s:e])  # [C, V]
                grad_h[s:e] = g @ w
                _accumulate(grad_w, g, hc)
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None


class _ChunkedWeightedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, token_weights, rows: int, dtype: torch.dtype):
        h, w = hidden.to(dtype), weight.to(dtype)
        token_weights = token_weights.float()
        losses = torch.empty(h.shape[0], device=h.device, dtype=torch.float32)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                e = s + rows
                hc = h[s:e]
                logits = hc @ w.t()  # [C, V]
                lse, picked, g = _run(_lse_target_and_grad, logits, targets[s:e], token_weights[s:e])
                losses[s:e] = lse - picked
                grad_h[s:e] = g @ w
                _accumulate(grad_w, g, hc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(losses)
        return (losses * token_weights).sum(), losses

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_sum, _grad_losses):
        grad_h, grad_w = ctx.saved_tensors  # the Function's own, called once: grad_w scaled in place
        grad_h = (grad_h.float() * grad_sum).to(ctx.dtypes[0])  # [T, D] (the scale not rounded to bf16)
        return grad_h, grad_w.mul_(grad_sum).to(ctx.dtypes[1]), None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int
) -> torch.Tensor:
    """Per-token loss [T] fp32, as `naive.linear_cross_entropy`, `rows` tokens' logits at a time."""
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, rows, _compute_dtype(hidden))


def chunked_weighted_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_weights: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weighted_token_losses` (see there), `rows` tokens' logits at a time, the gradients computed in the forward:
    (sum of losses * token_weights, 0-dim fp32 with autograd; the per-token losses [T] fp32, without)."""
    dtype = _compute_dtype(hidden)
    return _ChunkedWeightedCrossEntropy.apply(hidden, weight, targets, token_weights, rows, dtype)
