"""Routed experts as grouped matmuls over expert-sorted rows, free of host syncs (CUDA-graph capturable).

Legend: T tokens, A = experts per token, M = T * A (token, slot) rows, E routed experts, I expert intermediate
size, Din expert input width. Expert weights are stacked as in `naive`: w13 [E, 2I, Din], w2 [E, Din, I].

The rows are sorted by expert id on the device, so expert e owns rows offs[e - 1]:offs[e] (offs = cumulative
end offsets, offs[-1] = M). On CUDA in bf16, torch._grouped_mm multiplies every group in one kernel; elsewhere
a loop over all E experts (E comes from a weight shape, not from the data) computes each expert on every row
and keeps its own rows, which is wasteful but has no data-dependent shapes. Rows move between (token, slot) order
and expert order by gathers only, by the sort's order one way and its inverse the other, in training's backward
too: the scatter form (rows copied to pair order, then summed) took 45 ms of a 620 ms training step on `mini`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kestrel.env import env_field
from kestrel.ops.activation import glu_act
from kestrel.utils.fuse import for_training, records


def _grouped_linear_fallback(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row r of group g (offs[g - 1] <= r < offs[g]) times w[g].T. a [M, K], w [E, N, K] -> [M, N]."""
    group = _row_groups(offs, a.shape[0])  # [M]  rows past offs[-1] get group E: left at zero
    out = a.new_zeros(a.shape[0], w.shape[1])  # [M, N]
    for e in range(w.shape[0]):
        # torch.where, not a multiply by the mask: another group's overflow (inf, NaN) must not leak in.
        out = torch.where((group == e)[:, None], F.linear(a, w[e]), out)  # [M, N]
    return out


def _row_groups(offs: torch.Tensor, M: int) -> torch.Tensor:
    """[M]: the group of each of M rows by the cumulative ends offs [E] (rows past offs[-1]: E, no group)."""
    return torch.searchsorted(offs, torch.arange(M, device=offs.device, dtype=offs.dtype), right=True)


def _use_grouped_mm(a: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA, bf16 and 16-byte aligned strides (Din and I multiples of 8 in bf16)."""
    return (
        hasattr(torch, "_grouped_mm")
        and a.is_cuda
        and a.dtype == torch.bfloat16
        and a.shape[-1] % 8 == 0
        and w2.shape[-1] % 8 == 0
    )


def _grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grouped_mm: bool) -> torch.Tensor:
    """a [M, K] (rows grouped by offs [E] int32), w [E, N, K] -> [M, N] in a.dtype."""
    w = w.to(a.dtype)
    if grouped_mm:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)  # mat_b [E, K, N], column-major
    return _grouped_linear_fallback(a, w, offs)


def moe_experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    use_grouped_mm: bool | None = None,
    triton_combine: bool | None = None,
) -> torch.Tensor:
    """`naive.moe_experts` (same arguments, same result for ids in [0, E)) without host syncs.

    x [T, Din]; w13 [E, 2I, Din]; w2 [E, Din, I]; weights [T, A]; ids [T, A]; act 'silu' or 'situ'.
    use_grouped_mm None picks torch._grouped_mm where it applies (CUDA, bf16, aligned widths); tests force it.
    triton_combine None: the weighted sum back to tokens in one Triton kernel (`triton_experts.combine_sorted`)
    at inference on CUDA in bf16 or fp16, the torch form otherwise (autograd, fp32); tests force it. Ids outside
    [0, E) (another rank's experts under EP) add nothing.
    Returns [T, Din] in x.dtype, accumulated in fp32.
    """
    T, A = ids.shape
    E = w13.shape[0]
    if use_grouped_mm is None:
        use_grouped_mm = _use_grouped_mm(x, w2) and env_field("moe_grouped_mm") == "auto"
    if triton_combine is None:
        triton_combine = (
            x.is_cuda and not torch.is_grad_enabled() and x.dtype in (torch.bfloat16, torch.float16)
        )
    training = x.requires_grad and torch.is_grad_enabled()
    flat_ids = ids.reshape(-1)  # [M]
    order = torch.argsort(flat_ids, stable=True)  # [M]  expert-major, then token: row r is pair order[r]
    experts = torch.arange(E, device=ids.device, dtype=flat_ids.dtype)  # [E]
    offs = torch.searchsorted(flat_ids[order], experts, right=True, out_int32=True)  # [E] cumulative ends
    # inv [M]: pair p is row inv[p] (rows go back to their pairs by a gather too, never a scatter)
    inv = in_range = None
    if training or not triton_combine:
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        in_range = (ids >= 0) & (ids < E)  # [T, A]: the pairs whose expert is one of these

    # [M, 2I]: each pair's token row x[order // A] times its expert's up-projection (in training through
    # _GatherUp, which keeps x, not those rows, for its backward)
    if training:
        gate_up = _GatherUp.apply(x, w13, order, inv, offs, in_range, use_grouped_mm)
    else:
        gate_up = _grouped_linear(x[order // A], w13, offs, use_grouped_mm)
    h = glu_act(gate_up, act, situ_beta, situ_linear_beta)  # [M, I]
    if triton_combine:
        from kestrel.ops.moe.triton_experts import combine_sorted

        y = _grouped_linear(h, w2, offs, use_grouped_mm)  # [M, Din]
        return combine_sorted(y, order, weights, ids, E).to(x.dtype)
    return combine_down(h, w2, offs, order, inv, weights, in_range, use_grouped_mm).to(x.dtype)


class _GatherUp(torch.autograd.Function):
    """_grouped_linear(x[order // A], w13, offs): each (token, slot) pair's token row, expert-major, times its
    expert's up-projection. For its backward it keeps x [T, Din], not the gathered rows [M, Din] (A times x's
    size; on `mini` at 3 rows of 8704, 642 MB a layer, 15 GB a step), and gathers them again for the weights'
    gradient. x's gradient gathers each token's A rows (by inv) and sums them, one kernel where compiled, instead
    of autograd's accumulating scatter into x's rows (a sort, then a scatter: 13 ms a step on `mini` at two rows)
    or a copy back to pair order and a sum (21 ms). in_range [T, A]: the pairs whose id is one of these experts
    (the others, another rank's, add nothing to x's gradient, whatever their rows hold)."""

    @staticmethod
    def forward(ctx, x, w13, order, inv, offs, in_range, grouped_mm: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w13, order, inv, offs, in_range)
        ctx.grouped_mm = grouped_mm
        return _grouped_linear(x[order // in_range.shape[1]], w13, offs, grouped_mm)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, w13, order, inv, offs, in_range = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # [M, Din] rows' gradients, then each token's A of them summed
            rows = _grouped_linear(grad, w13.transpose(1, 2), offs, ctx.grouped_mm)
            grad_x = for_training(_sum_slots, rows)(rows, inv, in_range)
        if ctx.needs_input_grad[1]:
            A = in_range.shape[1]
            grad_w = _grouped_weight_grad(
                grad, x[order // A].to(grad.dtype), offs, w13.shape[0], ctx.grouped_mm
            )
            grad_w = grad_w.to(w13.dtype)
        return grad_x, grad_w, None, None, None, None, None


def _grouped_weight_grad(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, E: int, grouped_mm: bool):
    """The weights' gradient of _grouped_linear(a, w, offs): [E, N, K], group g's grad[rows of g].T @ a[rows of g]
    (grad [M, N], a [M, K], rows past offs[-1] in no group), in grad's dtype."""
    if grouped_mm:
        return torch._grouped_mm(grad.t(), a, offs=offs)  # [N, M] x [M, K] in groups along M
    group = _row_groups(offs, a.shape[0])
    mine = [(group == e)[:, None] for e in range(E)]
    # torch.where, not a product with the mask: another group's rows (inf, NaN) must not leak in
    return torch.stack([torch.where(m, grad, 0).t() @ torch.where(m, a, 0) for m in mine])


def _sum_slots(rows: torch.Tensor, inv: torch.Tensor, in_range: torch.Tensor) -> torch.Tensor:
    """Expert-major rows [M, D] -> [T, D] in their dtype: each token's rows of pairs in range ([T, A]) summed in fp32
    (fp64 stays). torch.where, not a product with the mask: the other rows may hold anything (torch._grouped_mm
    may leave the rows past offs[-1] unwritten)."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    mine = torch.where(in_range[..., None], rows[inv.view(in_range.shape)], 0)  # [T, A, D]
    return mine.sum(1, dtype=acc).to(rows.dtype)


def combine_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor,
    order: torch.Tensor,
    inv: torch.Tensor,
    weights: torch.Tensor,
    in_range: torch.Tensor,
    grouped_mm: bool,
) -> torch.Tensor:
    """The experts' down-projection of their rows, y = _grouped_linear(h, w2, offs) [M, Din] (row r is pair order[r],
    pair p is row inv[p]), weighted and summed back to the tokens: [T, Din] fp32 (weights [T, A]; pairs not
    in_range [T, A], those of ids outside [0, E), add nothing). In training, an autograd.Function whose backward
    keeps h [M, I], not y (Din / I times h's size: on `mini` at 4 rows of 8704, 855 MB a layer, 20 GB a step),
    nor w2 in h's dtype: the weights' gradient
    <grad[t], y[p]> is taken as <grad[t] w2, h[p]>, from the product that h's gradient needs anyway.
    `combine_down.eager`: the same through plain autograd (it keeps w2 in h's dtype and an fp32 copy of y's rows
    gathered to [T, A, Din])."""
    if records(h, w2, weights):
        return _CombineDown.apply(h, w2, weights, in_range, order, inv, offs, grouped_mm)
    return _combine_down_eager(h, w2, offs, order, inv, weights, in_range, grouped_mm)


def _combine_down_eager(h, w2, offs, order, inv, weights, in_range, grouped_mm):
    """`combine_down` as written, and as plain autograd differentiates it (the reference)."""
    return _weighted_sum(_grouped_linear(h, w2, offs, grouped_mm), weights, in_range, inv)


combine_down.eager = _combine_down_eager


class _CombineDown(torch.autograd.Function):
    """`combine_down` in training. Forward: the down-projection, then the weighted sum (one kernel where
    compiled, `for_training`), y dropped. Backward: each row's token gradient gathered (unweighted) and multiplied
    by its expert's w2 once; from that product [M, I], h's gradient (times the row's weight), the weights' gradient
    (its dot with h) and the weighted h for w2's gradient, in one compiled graph."""

    @staticmethod
    def forward(ctx, h, w2, weights, in_range, order, inv, offs, grouped_mm: bool):
        ctx.save_for_backward(h, w2, weights, in_range, order, inv, offs)
        ctx.grouped_mm = grouped_mm
        y = _grouped_linear(h, w2, offs, grouped_mm)  # [M, Din]
        return for_training(_weighted_sum, y)(y, weights, in_range, inv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        h, w2, weights, in_range, order, inv, offs = ctx.saved_tensors
        rows = for_training(_token_rows, grad)(grad, order, in_range.shape[1], h.dtype)  # [M, Din]
        back = _grouped_linear(rows, w2.transpose(1, 2), offs, ctx.grouped_mm)  # [M, I]: grad[t] w2
        grad_h, weighted_h, grad_w = for_training(_down_grads, back)(back, h, weights, in_range, order, inv)
        grad_w2 = None
        if ctx.needs_input_grad[1]:
            grad_w2 = _grouped_weight_grad(rows, weighted_h, offs, w2.shape[0], ctx.grouped_mm).to(w2.dtype)
        return grad_h, grad_w2, grad_w.to(weights.dtype), None, None, None, None, None


def _weighted_sum(y, weights, in_range, inv) -> torch.Tensor:
    """[T, Din] fp32: sum over slots a of weights[t, a] * y[inv[t * A + a]] where in_range[t, a]."""
    rows = y[inv.view(in_range.shape)].float()  # [T, A, Din]
    # torch.where, not a product with the mask: rows of ids outside [0, E) hold no expert's output (inf, NaN)
    return (torch.where(in_range[..., None], rows, 0.0) * weights[..., None].float()).sum(1)


def _token_rows(grad, order, A: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, Din] in dtype: row r (pair p = order[r]) gets its token's gradient, unweighted (rows of ids outside
    [0, E) too: `_down_grads` keeps them out of every gradient)."""
    return grad[order // A].to(dtype)


def _down_grads(back, h, weights, in_range, order, inv):
    """From back = rows x w2 [M, I] (each row's token gradient through its expert's down-projection): h's
    gradient (back times the row's weight) and the weighted h for w2's gradient, both in h's dtype, and the
    weights' gradient [T, A] fp32 (<back, h> a row: <grad[t], y[p]>). torch.where, not products with a mask: rows
    of ids outside [0, E) may hold anything (no expert wrote them) and must reach none of the three."""
    acc = torch.promote_types(h.dtype, torch.float32)  # fp64 stays
    keep = in_range.view(-1)[order, None]  # [M, 1]
    w = torch.where(keep, weights.to(acc).view(-1)[order, None], 0.0)  # [M, 1]
    back32, h32 = back.to(acc), h.to(acc)
    grad_h = torch.where(keep, w * back32, 0.0).to(h.dtype)
    weighted_h = torch.where(keep, w * h32, 0.0).to(h.dtype)
    dots = (back32 * h32).sum(-1)  # [M]
    return grad_h, weighted_h, torch.where(in_range, dots[inv.view(in_range.shape)], 0.0)


@functools.cache
def grouped_mm_trains(device_type: str) -> bool:
    """Whether torch._grouped_mm has a working backward here (probed once on a tiny problem): the training
    path uses the grouped experts only then, the per-expert loop otherwise."""
    if device_type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 32], device="cuda", dtype=torch.int32)
        torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).float().sum().backward()
        return a.grad is not None and w.grad is not None
    except (RuntimeError, NotImplementedError):
        return False
