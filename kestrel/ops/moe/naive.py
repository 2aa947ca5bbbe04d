"""Mixture-of-experts references (model-spec 3): sigmoid router with correction bias, experts, latent MoE.

Legend: T tokens, D hidden, E routed experts, A = experts per token, I expert intermediate size,
G expert groups, L latent width of a latent MoE. Expert weights are stacked: w13 [E, 2I, Din] (gate rows
first, then up rows), w2 [E, Din, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.ops.activation import glu_act
from kestrel.ops.norm import rms_norm


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, best first; ties keep the lower index first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    num_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing, in fp32.

    logits [T, E] (router matmul output). s = sigmoid(logits); s_sel = s + bias (selection only).
    With num_groups > 1: group score = sum of the top-2 s_sel in each of the G groups; keep the best
    topk_groups groups, mask the rest. Select top_k experts by s_sel (ties: lower expert id first).
    Weights w = s[ids]; if renormalize: w /= (sum w + 1e-20); w *= scaling_factor.
    Returns (weights [T, A] fp32, ids [T, A] int64), in selection order (best first).
    """
    T, E = logits.shape
    scores = torch.sigmoid(logits.float())  # [T, E]
    sel = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    if num_groups > 1:
        assert E % num_groups == 0, f"{E} experts do not split into {num_groups} groups"
        per_group = E // num_groups
        assert top_k <= topk_groups * per_group, "top_k exceeds the experts of the kept groups"
        grouped = sel.view(T, num_groups, per_group)  # [T, G, E/G]
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)  # [T, G]
        keep.scatter_(1, _stable_topk(group_scores, topk_groups), True)
        sel = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)  # [T, E]
    ids = _stable_topk(sel, top_k)  # [T, A]
    weights = scores.gather(1, ids)  # [T, A]
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def replay_route(
    logits: torch.Tensor, ids: torch.Tensor, renormalize: bool, scaling_factor: float
) -> torch.Tensor:
    """Routing replay: the weights `route` would give if it had selected `ids` [T, A] (e.g. the experts the
    engine chose during a rollout). logits [T, E]. Returns weights [T, A] fp32."""
    weights = torch.sigmoid(logits.float()).gather(1, ids)  # [T, A]
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling_factor


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """sum_a weights[t, a] * E_{ids[t, a]}(x_t), with E(x) = w2 @ act(gate, up), [gate | up] = w13 @ x.

    x [T, Din]; w13 [E, 2I, Din]; w2 [E, Din, I]; weights [T, A]; ids [T, A]; act 'silu' or 'situ'
    (kestrel.ops.activation.glu_act). Loops over the experts that received tokens. Returns [T, Din] in
    x.dtype, accumulated in fp32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, Din]
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)  # [n], [n]
        gate_up = F.linear(x[tok], w13[e].to(x.dtype))  # [n, 2I]
        h = glu_act(gate_up, act, situ_beta, situ_linear_beta)  # [n, I]
        y = F.linear(h, w2[e].to(x.dtype))  # [n, Din]
        out.index_add_(0, tok, y.float() * weights[tok, slot, None].float())
    return out.to(x.dtype)


def glu_mlp(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """Dense GLU MLP w2 @ act(gate, up), [gate | up] = w13 @ x (dense prefix layers and shared experts).

    x [..., D]; w13 [2I, D] (gate rows, then up rows); w2 [D, I]. Returns [..., D] in x.dtype.
    """
    h = glu_act(F.linear(x, w13.to(x.dtype)), act, situ_beta, situ_linear_beta)  # [..., I]
    return F.linear(h, w2.to(x.dtype))  # [..., D]


def latent_moe(
    x: torch.Tensor,
    down_w: torch.Tensor,
    up_w: torch.Tensor,
    norm_w: torch.Tensor | None,
    eps: float,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> torch.Tensor:
    """Routed part of a latent MoE (K3): up_w @ RMSNorm_norm_w( sum_a w_a E_a(down_w @ x) ).

    x [T, D]; down_w [L, D]; up_w [D, L]; norm_w [L] or None (no norm); w13 [E, 2I, L]; w2 [E, L, I];
    weights, ids [T, A] from `route` on the full-width x. Returns [T, D] in x.dtype; shared experts are
    the caller's. Under TP the latent sum must be all-reduced before the norm, which is why it sits here.
    """
    latent = F.linear(x, down_w.to(x.dtype))  # [T, L]
    mixed = moe_experts(latent, w13, w2, weights, ids, act, situ_beta, situ_linear_beta)  # [T, L]
    if norm_w is not None:
        mixed = rms_norm(mixed, norm_w, eps)  # [T, L]
    return F.linear(mixed, up_w.to(x.dtype))  # [T, D]
