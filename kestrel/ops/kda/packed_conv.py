"""The KDA short conv over packed varlen sequences, in a fixed number of batched tensor ops.

The reference `naive.short_conv` loops over the sequences, which costs a few kernels per sequence: thousands
per training step of short packed documents. Here every sequence is laid out behind its own W - 1 state
rows in one buffer, and every token's window is gathered from that buffer at once. No host syncs.
Legend: T packed tokens, N sequences, C channels, W conv width, S = W - 1 state columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.ops.kda.naive import _compute_dtype, as_planes


def short_conv_packed(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    planes: int = 1,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `naive.short_conv` (it reads no layout on the host: cu_seqlens_cpu is unused):
    x [T, C], weight [C, W], conv_state [N, C, W - 1] or None,
    cu_seqlens [N + 1] or None (one sequence). Returns (y [T, C] in x.dtype, or [planes, T, C / planes] as a
    view, new_state [N, C, W - 1])."""
    T, C = x.shape
    W = weight.shape[-1]
    S = W - 1
    device = x.device
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    N = cu.numel() - 1
    if conv_state is None:
        conv_state = x.new_zeros(N, C, S)
    assert conv_state.shape == (N, C, S), f"conv_state {tuple(conv_state.shape)} != {(N, C, S)}"
    dtype = _compute_dtype(x)

    # Padded layout: sequence n occupies rows [cu[n] + n*S, cu[n+1] + (n+1)*S): its S state rows, then its tokens.
    tokens = torch.arange(T, device=device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)  # [T] sequence of every token
    dest = tokens + (seq + 1) * S  # [T] row of every token in the padded buffer
    state_rows = (cu[:-1] + torch.arange(N, device=device) * S)[:, None] + torch.arange(
        S, device=device
    )  # [N, S]
    state = conv_state.to(x.dtype).to(dtype)  # rounded through x.dtype, as the reference does
    # the token rows and the state rows together fill the buffer exactly: one scatter builds it
    rows = torch.cat([dest, state_rows.flatten()])
    values = torch.cat([x.to(dtype), state.transpose(1, 2).reshape(N * S, C)])
    padded = values.new_empty(T + N * S, C).index_copy(0, rows, values)
    y = F.silu(_WindowConv.apply(padded, weight.to(dtype), dest - S)).to(x.dtype)

    ends = cu[1:] + (torch.arange(N, device=device) + 1) * S  # [N] one past each sequence's last row
    last = (ends[:, None] - S + torch.arange(S, device=device)).flatten()  # [N * S]
    new_state = padded.index_select(0, last).view(N, S, C).transpose(1, 2).to(x.dtype)
    return as_planes(y, planes), new_state


class _WindowConv(torch.autograd.Function):
    """pre[t] = sum_j weight[:, j] * padded[start[t] + j]: the conv of each token's window of W buffer rows.

    Autograd through a gathered [T, C, W] copy would keep it for the weight gradient (W times the input);
    this keeps only the buffer and gathers the windows again in the backward."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor, weight: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(padded, weight, start)
        windows = padded.unfold(0, weight.shape[-1], 1).index_select(0, start)  # [T, C, W], transient
        return (windows * weight).sum(-1)  # [T, C]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded, weight, start = ctx.saved_tensors
        d_padded = d_weight = None
        if ctx.needs_input_grad[0]:
            d_padded = torch.zeros_like(padded)
            for j in range(weight.shape[-1]):
                d_padded.index_add_(0, start + j, grad * weight[:, j])
        if ctx.needs_input_grad[1]:
            windows = padded.unfold(0, weight.shape[-1], 1).index_select(0, start)  # [T, C, W]
            d_weight = torch.einsum("tc,tcw->cw", grad, windows)
        return d_padded, d_weight, None
