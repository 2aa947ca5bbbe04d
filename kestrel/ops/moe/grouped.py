"""Routed experts as grouped matmuls over expert-sorted rows, free of host syncs (CUDA-graph capturable).

Legend: T tokens, A = experts per token, M = T * A (token, slot) rows, E routed experts, I expert intermediate
size, Din expert input width. Expert weights are stacked as in `naive`: w13 [E, 2I, Din], w2 [E, Din, I].

The rows are sorted by expert id on the device, so expert e owns rows offs[e - 1]:offs[e] (offs = cumulative
end offsets, offs[-1] = M). On CUDA in bf16, torch._grouped_mm multiplies every group in one kernel; elsewhere
a loop over all E experts (E comes from a weight shape, not from the data) computes each expert on every row
and keeps its own rows, which is wasteful but has no data-dependent shapes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kestrel.env import env_field
from kestrel.ops.activation import glu_act
from kestrel.utils.fuse import fused


def _grouped_linear_fallback(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Row r of group g (offs[g - 1] <= r < offs[g]) times w[g].T. a [M, K], w [E, N, K] -> [M, N]."""
    row = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)  # [M]
    group = torch.searchsorted(offs, row, right=True)  # [M]  rows past offs[-1] get group E: left at zero
    out = a.new_zeros(a.shape[0], w.shape[1])  # [M, N]
    for e in range(w.shape[0]):
        # torch.where, not a multiply by the mask: another group's overflow (inf, NaN) must not leak in.
        out = torch.where((group == e)[:, None], F.linear(a, w[e]), out)  # [M, N]
    return out


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
    flat_ids = ids.reshape(-1)  # [M]
    order = torch.argsort(flat_ids, stable=True)  # [M]  expert-major, then token order
    experts = torch.arange(E, device=ids.device, dtype=flat_ids.dtype)  # [E]
    offs = torch.searchsorted(flat_ids[order], experts, right=True, out_int32=True)  # [E] cumulative ends

    # [M, Din]: each pair's token row (in training through _PairRows, whose backward needs no sort)
    if x.requires_grad and torch.is_grad_enabled():
        rows = _PairRows.apply(x, order, A)
    else:
        rows = x[order // A]
    gate_up = _grouped_linear(rows, w13, offs, use_grouped_mm)  # [M, 2I]
    h = glu_act(gate_up, act, situ_beta, situ_linear_beta)  # [M, I]
    y = _grouped_linear(h, w2, offs, use_grouped_mm)  # [M, Din]
    if triton_combine is None:
        triton_combine = (
            x.is_cuda and not torch.is_grad_enabled() and x.dtype in (torch.bfloat16, torch.float16)
        )
    if triton_combine:
        from kestrel.ops.moe.triton_experts import combine_sorted

        return combine_sorted(y, order, weights, ids, E).to(x.dtype)
    return combine_pairs(y, order, weights, ids, E).to(x.dtype)


class _PairRows(torch.autograd.Function):
    """x[order // A]: each (token, slot) pair's token row, in `order` (a permutation of the T * A pairs). Its backward
    sums each token's A rows by a copy to the pairs' own rows and a reduction, as `combine_pairs` does, instead of
    autograd's accumulating scatter of x[token] (a sort, then a scatter: 13 ms a step on `mini` at two rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, A: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.A = A
        return x[order // A]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return _sum_to_tokens(grad, order, ctx.A), None, None


@fused()
def combine_pairs(
    y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The experts' rows y [M, Din] (expert-major: row r is pair order[r]) weighted and summed back to their
    tokens: [T, Din] fp32 (ids, weights [T, A]; ids outside [0, num_experts) add nothing). One op, so that in
    training (compiled) its backward keeps y as it came (bf16) rather than its fp32 copy times the weights
    ([M, Din] x 4 bytes a layer: on `mini`, 24 x 428 MB over one 8704-token row)."""
    A = ids.shape[1]
    flat_ids = ids.reshape(-1)  # [M]
    w = weights.reshape(-1)[order, None].float()  # [M, 1]
    in_range = ((flat_ids >= 0) & (flat_ids < num_experts))[order, None]  # [M, 1] (ids < 0 sort first)
    y = torch.where(in_range, y.float() * w, 0.0)  # [M, Din] expert-major
    return _sum_to_tokens(y, order, A)


def _sum_to_tokens(rows: torch.Tensor, order: torch.Tensor, A: int) -> torch.Tensor:
    """Expert-major pair rows [M, Din] (row r is pair order[r]) -> [T, Din]: back to (token, slot) order, then
    each token's A rows summed in slot order: a copy to distinct rows and a reduction, with no atomics (index_add_
    into T rows serializes on repeated tokens and sums in no set order)."""
    pairs = torch.empty_like(rows).index_copy_(0, order, rows)  # [M, Din]
    return pairs.view(-1, A, rows.shape[1]).sum(1)


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
