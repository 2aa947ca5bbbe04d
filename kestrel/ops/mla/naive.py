"""Multi-head latent attention (MLA) references over a latent cache (model-spec 2.1-2.2), NoPE as in Kimi.

Legend: T query tokens of one sequence, L cached tokens of that sequence (the new ones included), H heads,
R kv_lora_rank, P qk_rope_head_dim, Dn qk_nope_head_dim, Dv v_head_dim, k selected tokens per query;
B sequences with caches padded to Lmax tokens in the batched decode form.
Latent cache row of a token: [c_kv (R, already RMS-normed) | k_pe (P)].
kv_b_proj weight [H * (Dn + Dv), R]; per head rows [0:Dn] give W_UK^h, rows [Dn:Dn+Dv] give W_UV^h.
A query at position `q_pos[t]` sees cache rows 0..q_pos[t] (causal, itself included). With `indices`
[T, k] (-1 = unused) it sees only those rows (the DSA selection); the softmax is over the visible rows only.
Selected rows past q_pos[t] stay hidden (the selection is intersected with the causal set).
"fp32 inside" means at least fp32: fp64 inputs are computed in fp64, so tests can compare tightly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kestrel.ops.dsa.naive import selection_mask
from kestrel.ops.norm import layer_norm, rms_norm
from kestrel.utils.fuse import fused


@fused("kestrel.ops.mla.triton_write:write_rows_triton")
def write_rows(
    pool: torch.Tensor,
    rows: torch.Tensor,
    parts: tuple[torch.Tensor, ...],
    index_pool: torch.Tensor | None = None,
    index_keys: torch.Tensor | None = None,
    kv_norm: tuple | None = None,
    index_norm: tuple | None = None,
) -> None:
    """The latent cache write: pool[rows[t]] = token t's parts side by side (c_kv [T, R], then k_pe [T, P]),
    in pool's dtype; with index_pool, index_pool[rows[t]] = index_keys[t] [T, DI] as well. rows [T] int64.
    kv_norm (weight [R], eps): the first part is c_kv before its RMSNorm, applied here; index_norm (weight [DI],
    bias [DI], eps): the keys before their LayerNorm, likewise (decode writes them so: the fast kernel norms
    each row as it stores it, no launch of their own)."""
    parts, index_keys = write_norms(parts, index_keys, kv_norm, index_norm)
    pool[rows] = torch.cat(parts, dim=-1).to(pool.dtype)
    if index_pool is not None:
        index_pool[rows] = index_keys.to(index_pool.dtype)


class WriteNorms(NamedTuple):
    """The norms a decode step's cache write applies to the new rows (`CacheView.write_kv`): c_kv's RMSNorm
    (weight, eps) and the indexer keys' LayerNorm (weight, bias, eps); None: that part comes normed."""

    kv: tuple | None = None
    index: tuple | None = None


def write_norms(
    parts: tuple[torch.Tensor, ...], index_keys: torch.Tensor | None, kv_norm=None, index_norm=None
):
    """(parts, index_keys) as the cache stores them: c_kv (the first part) RMS-normed with kv_norm (weight, eps),
    the keys layer-normed with index_norm (weight, bias, eps); as given where a norm is None."""
    if kv_norm is not None:
        parts = (rms_norm(parts[0], *kv_norm), *parts[1:])
    if index_norm is not None and index_keys is not None:
        index_keys = layer_norm(index_keys, *index_norm)
    return parts, index_keys


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int):
    """kv_b_proj weight [H*(Dn+Dv), R] -> (w_uk [H, Dn, R], w_uv [H, Dv, R])."""
    w = kv_b_weight.unflatten(0, (num_heads, nope_dim + v_dim))  # [H, Dn + Dv, R]
    w_uk, w_uv = w.split([nope_dim, v_dim], dim=1)  # [H, Dn, R], [H, Dv, R]
    return w_uk, w_uv


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _visible(q_pos: torch.Tensor, length: int, indices: torch.Tensor | None) -> torch.Tensor:
    """bool [T, L]: the cache rows each query attends to."""
    pos = torch.arange(length, device=q_pos.device)  # [L]
    visible = pos[None, :] <= q_pos[:, None]  # [T, L]
    if indices is not None:
        visible = visible & selection_mask(indices, length)  # [T, L]
    assert bool(visible.any(dim=1).all()), "a query sees no cache row"
    return visible


def _probs(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """scores [T, H, L], visible [T, L] -> softmax over the visible rows [T, H, L]."""
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))  # [T, H, L]
    return torch.softmax(scores, dim=-1)


def mla_attention_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    v_dim: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """MHA form: expand every cached latent into per-head k_nope, v with kv_b_proj, then attend.

    q_nope [T, H, Dn], q_pe [T, H, P], kv_cache [L, R + P], q_pos [T] int64 positions in [0, L).
    score[t, h, s] = (q_nope . k_nope[s, h] + q_pe . k_pe[s]) * scale.
    Returns o [T, H, Dv] in q_nope.dtype, fp32 inside.
    """
    dt = _compute_dtype(q_nope)
    T, H, Dn = q_nope.shape
    P = q_pe.shape[-1]
    L, RP = kv_cache.shape
    c_kv, k_pe = kv_cache.to(dt).split([RP - P, P], dim=-1)  # [L, R], [L, P]
    w_uk, w_uv = split_kv_b(kv_b_weight.to(dt), H, Dn, v_dim)  # [H, Dn, R], [H, Dv, R]
    k_nope = torch.einsum("hdr,lr->lhd", w_uk, c_kv)  # [L, H, Dn]
    v = torch.einsum("hdr,lr->lhd", w_uv, c_kv)  # [L, H, Dv]
    scores = torch.einsum("thd,lhd->thl", q_nope.to(dt), k_nope)  # [T, H, L]
    scores = (scores + torch.einsum("thp,lp->thl", q_pe.to(dt), k_pe)) * scale  # [T, H, L]
    p = _probs(scores, _visible(q_pos, L, indices))  # [T, H, L]
    o = torch.einsum("thl,lhd->thd", p, v)  # [T, H, Dv]
    return o.to(q_nope.dtype)


def mla_attention_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed (decode) form, same result as `mla_attention_expanded`:
    q_lat^h = W_UK^h^T q_nope^h [R]; score = (q_lat . c_kv + q_pe . k_pe) * scale; o_lat = softmax @ c_kv;
    o^h = W_UV^h o_lat^h.  w_uk [H, Dn, R], w_uv [H, Dv, R].
    Returns o [T, H, Dv] in q_nope.dtype, fp32 inside.
    """
    dt = _compute_dtype(q_nope)
    P = q_pe.shape[-1]
    L, RP = kv_cache.shape
    c_kv, k_pe = kv_cache.to(dt).split([RP - P, P], dim=-1)  # [L, R], [L, P]
    q_lat = torch.einsum("thd,hdr->thr", q_nope.to(dt), w_uk.to(dt))  # [T, H, R]
    scores = torch.einsum("thr,lr->thl", q_lat, c_kv)  # [T, H, L]
    scores = (scores + torch.einsum("thp,lp->thl", q_pe.to(dt), k_pe)) * scale  # [T, H, L]
    p = _probs(scores, _visible(q_pos, L, indices))  # [T, H, L]
    o_lat = torch.einsum("thl,lr->thr", p, c_kv)  # [T, H, R]
    o = torch.einsum("thr,hdr->thd", o_lat, w_uv.to(dt))  # [T, H, Dv]
    return o.to(q_nope.dtype)


def mla_decode_batched(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mla_attention_absorbed` for one query per sequence over B padded caches, free of host syncs (the
    decode step runs as one CUDA graph).

    q_nope [B, H, Dn], q_pe [B, H, P], kv [B, Lmax, R + P] (row b holds sequence b's cache; positions
    >= lens[b] may hold anything, NaN included), lens [B] int64 (the query sits at position lens[b] - 1),
    w_uk [H, Dn, R], w_uv [H, Dv, R], indices [B, k] (-1 = unused; entries past the query are ignored).
    A row that sees nothing (lens[b] = 0, e.g. graph padding) gives zeros instead of the reference's
    assertion. Returns o [B, H, Dv] in q_nope.dtype, fp32 inside.
    """
    dt = _compute_dtype(q_nope)
    B, Lmax, RP = kv.shape
    P = q_pe.shape[-1]
    pos = torch.arange(Lmax, device=kv.device)  # [Lmax]
    visible = pos[None, :] < lens[:, None]  # [B, Lmax]
    if indices is not None:
        # selection_mask without its range assertion (a host sync); the extra column soaks up -1 padding.
        slot = torch.where((indices < 0) | (indices >= Lmax), Lmax, indices).long()  # [B, k]
        chosen = torch.zeros(B, Lmax + 1, dtype=torch.bool, device=kv.device).scatter_(1, slot, True)
        visible = visible & chosen[:, :Lmax]  # [B, Lmax]
    # Zero the hidden rows: masked scores alone would still let 0 * NaN reach o_lat.
    kv = torch.where(visible[:, :, None], kv.to(dt), 0)  # [B, Lmax, R + P]
    c_kv, k_pe = kv.split([RP - P, P], dim=-1)  # [B, Lmax, R], [B, Lmax, P]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope.to(dt), w_uk.to(dt))  # [B, H, R]
    scores = torch.einsum("bhr,blr->bhl", q_lat, c_kv)  # [B, H, Lmax]
    scores = (scores + torch.einsum("bhp,blp->bhl", q_pe.to(dt), k_pe)) * scale  # [B, H, Lmax]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))  # [B, H, Lmax]
    # A row with nothing visible softmaxes to NaN; the where turns it into zeros.
    p = torch.where(visible[:, None, :], torch.softmax(scores, dim=-1), 0)  # [B, H, Lmax]
    o_lat = torch.einsum("bhl,blr->bhr", p, c_kv)  # [B, H, R]
    o = torch.einsum("bhr,hdr->bhd", o_lat, w_uv.to(dt))  # [B, H, Dv]
    return o.to(q_nope.dtype)


def mla_attention_rows(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_b_weight: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    v_dim: int,
    flex: bool = False,
) -> torch.Tensor:
    """Training/prefill form over B rows of R tokens with an explicit visibility mask, MHA-expanded, through
    scaled_dot_product_attention (a fused kernel on CUDA, the math path on CPU), or with flex through
    FlexAttention over the mask's visible blocks (kestrel.ops.mla.flex_rows; CUDA, R a multiple of 128).

    q [B, R, H, Dn + P] ([q_nope | q_pe], as the query projection lays it out: no copy to join them), kv
    [B, R, Rk + P] (the rows' own latent rows, [c_kv | k_pe]), kv_b_weight [H * (Dn + Dv), Rk], allowed
    [B, R, R] bool (query t may attend key s; every query must allow at least itself). Returns o [B, R, H, Dv]
    in q.dtype.
    """
    B, R, H, Dq = q.shape
    Dn = kv_b_weight.shape[0] // H - v_dim
    P = Dq - Dn
    assert kv.shape[-1] > P > 0, f"q width {Dq}, nope {Dn}, latent row {kv.shape[-1]}"
    c_kv, k_pe = kv.split([kv.shape[-1] - P, P], dim=-1)  # [B, R, Rk], [B, R, P]
    kvb = torch.nn.functional.linear(c_kv, kv_b_weight.to(c_kv.dtype)).view(B, R, H, Dn + v_dim)
    k_nope, v = kvb.split([Dn, v_dim], dim=-1)  # [B, R, H, Dn], [B, R, H, Dv]
    q = q.transpose(1, 2)  # [B, H, R, Dn + P]
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, R, H, P)], dim=-1).transpose(
        1, 2
    )  # [B, H, R, Dn + P]
    k, v = k.to(q.dtype), v.transpose(1, 2).to(q.dtype)
    if flex:
        from kestrel.ops.mla.flex_rows import flex_attention_rows

        o = flex_attention_rows(q, k, v, allowed, scale)  # [B, H, R, Dv]: the visible blocks only
    else:
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[:, None], scale=scale
        )  # [B, H, R, Dv]
    return o.transpose(1, 2).to(q.dtype)
