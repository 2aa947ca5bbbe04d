"""Attention Residuals (AttnRes) mixing (model-spec 4.1).

Legend: S sources, T tokens, D hidden.
"""

from __future__ import annotations

import torch

from kestrel.ops.norm.naive import rms_norm
from kestrel.utils.fuse import fused


@fused("kestrel.ops.attnres.triton_mix:attnres_mix_triton")
def attnres_mix(
    sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax-weighted sum of the raw sources, in fp32.

    sources [S, T, D]; query [D] (`*_res_proj.weight` flattened); norm_weight [D] (`*_res_norm.weight`).
    e_j = (norm_weight * query) . (r_j / sqrt(mean(r_j^2) + eps)); p = softmax_j(e); mix = sum_j p_j r_j.
    Returns mix [T, D] in sources.dtype (the caller applies the sublayer's output RMSNorm).
    """
    r = sources.float()  # [S, T, D]
    keys = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)  # [S, T, D]
    # the norm weight folds into the query: (w * k) . q == k . (w * q)
    q = (norm_weight.float() * query.float()).flatten()  # [D]
    p = torch.softmax(keys @ q, dim=0)  # [S, T]
    mix = (p[..., None] * r).sum(0)  # [T, D]
    return mix.to(sources.dtype)


@fused("kestrel.ops.attnres.triton_mix:attnres_mix_norm_triton")
def attnres_mix_norm(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
    last: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """`attnres_mix`, then the consumer's RMSNorm (out_weight, out_eps) of the mix rounded to sources.dtype: what
    every AttnRes consumer applies (model-spec 4.1: the sublayer's pre-norm, or the final norm). One op so that
    the fast path does both in one pass (a [T, D] write and read fewer per consumer: 48 of them in a prefill step
    of `mini`). `last` [T, D], where given, is one more source after `sources` (training's running sum: the fast
    path reads it where it is instead of a copy stacked with the rest). `update` [T, D], where given, first goes
    into the last source in place: added to it (`accumulate`) or copied over it (inference's running sum taking a
    sublayer's output: the fast path does it as it reads the sources, one launch fewer). Returns [T, D] in
    sources.dtype."""
    if update is not None:
        assert last is None, "update goes into the last of `sources`: not with `last`"
        if accumulate:
            sources[-1].add_(update)
        else:
            sources[-1].copy_(update)
    if last is not None:
        assert last.shape == sources.shape[1:] and last.dtype == sources.dtype, (
            f"last {tuple(last.shape)} {last.dtype}, sources {tuple(sources.shape)} {sources.dtype}"
        )
        sources = torch.cat([sources, last[None]])  # [S + 1, T, D]
    mixed = attnres_mix.eager(sources, query, norm_weight, eps)
    return rms_norm.eager(mixed, out_weight, out_eps)
