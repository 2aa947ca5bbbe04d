"""AttnRes mixing (model-spec 4). Each consumer (a layer's attention side, its MLP side, the output) owns a
pseudo-query `*_res_proj.weight [1, D]` and a source-norm weight `*_res_norm.weight [D]`."""

from __future__ import annotations

import torch
from torch import nn

from kestrel.layers.linear import set_loader
from kestrel.layers.norm import RMSNorm
from kestrel.ops.attnres import Bank, attnres_mix, attnres_mix_norm


class ResProj(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = set_loader(nn.Parameter(torch.zeros(1, dim, dtype=dtype)))  # zero init: uniform mixing


def mix(sources: list[torch.Tensor] | torch.Tensor, proj: ResProj, norm: RMSNorm) -> torch.Tensor:
    """Softmax-mix the raw sources (a list of [T, D], or already stacked [S, T, D]) with this consumer's
    pseudo-query; the pre-norm comes after."""
    if len(sources) == 1:
        return sources[0]  # softmax over one source is 1
    return attnres_mix(_stacked(sources), proj.weight.view(-1), norm.weight, norm.eps)


def mix_norm(
    sources: list[torch.Tensor] | torch.Tensor,
    proj: ResProj,
    norm: RMSNorm,
    out_norm: RMSNorm,
    update: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """out_norm(mix(sources, proj, norm)): the mix and the consumer's pre-norm (or the final norm), one op.
    `update` [T, D] first goes into the last source in place, added (`accumulate`) or copied (sources: a view of
    inference's buffer, not a list)."""
    if update is not None:
        assert isinstance(sources, torch.Tensor), "an update goes into a tensor's rows in place"
        if len(sources) == 1:  # softmax over one source is 1: no mix to take the update
            if accumulate:
                sources[0].add_(update)
            else:
                sources[0].copy_(update)
            update = None
    if len(sources) == 1:
        return out_norm(sources[0])
    return attnres_mix_norm(
        _stacked(sources), proj.weight.view(-1), norm.weight, norm.eps, out_norm.weight, out_norm.eps,
        update=update, accumulate=accumulate,
    )  # fmt: skip


def mix_norm_bank(
    bank: Bank, partial: torch.Tensor | None, proj: ResProj, norm: RMSNorm, out_norm: RMSNorm
) -> torch.Tensor:
    """`mix_norm` over training's bank: its entries, and the running sum where given."""
    if len(bank) + (partial is not None) == 1:
        return out_norm(partial if partial is not None else bank.sources[0])  # softmax over one source is 1
    return bank.mix_norm(partial, proj.weight.view(-1), norm.weight, norm.eps, out_norm.weight, out_norm.eps)


def _stacked(sources: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """[S, T, D]: a list stacked (training's bank), a tensor as it is (inference's buffer view)."""
    return sources if isinstance(sources, torch.Tensor) else torch.stack(sources)
