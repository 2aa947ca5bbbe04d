"""Dense MLA prefill through torch's fused attention (`F.scaled_dot_product_attention`): the fast path of
`naive.mla_attention_absorbed` without a DSA selection, for a prefill chunk whose queries are the last T of the
L cached tokens (positions L - T .. L - 1).

The absorbed form is the decode form: for a prefill chunk it multiplies in the R-wide latent space (R = 512 with
P = 64 against Dn + P = 192 and Dv = 128 expanded), in fp32, and materializes [T, H, L] scores. Here keys and
values are expanded once per chunk (W_UK and W_UV on the latent rows) and attention runs in the input dtype in
one fused kernel (on CUDA the memory-efficient one: flash needs v as wide as q and k). Legend as in naive.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_history(
    kv: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent rows kv [..., L, R + P] -> per-head keys [..., L, H, Dn], rope keys [..., L, P] and values
    [..., L, H, Dv] in dtype (one GEMM each for keys and values). w_uk [H, Dn, R], w_uv [H, Dv, R]."""
    H, Dn, R = w_uk.shape
    Dv = w_uv.shape[1]
    c_kv, k_pe = kv.to(dtype).split([R, kv.shape[-1] - R], dim=-1)  # [..., L, R], [..., L, P]
    k = (c_kv @ w_uk.to(dtype).reshape(H * Dn, R).T).unflatten(-1, (H, Dn))  # [..., L, H, Dn]
    v = (c_kv @ w_uv.to(dtype).reshape(H * Dv, R).T).unflatten(-1, (H, Dv))  # [..., L, H, Dv]
    return k, k_pe.contiguous(), v


def mla_prefill_sdpa(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_pe [T, H, P] of the chunk's tokens, the last T of kv_cache [L, R + P]; w_uk [H, Dn, R],
    w_uv [H, Dv, R]. Returns o [T, H, Dv] in q_nope.dtype: each query attends causally to rows 0..its position.
    Batched: q_nope [G, T, H, Dn], q_pe [G, T, H, P], kv_cache [G, L, R + P] -> o [G, T, H, Dv], G sequences of
    one shape in one call (their keys and values expanded in one GEMM each)."""
    batched = q_nope.dim() == 4
    if not batched:
        q_nope, q_pe, kv_cache = q_nope[None], q_pe[None], kv_cache[None]
    G, T, H, _ = q_nope.shape
    P = q_pe.shape[-1]
    L = kv_cache.shape[1]
    assert T <= L, f"{T} queries over {L} cached rows: the chunk's own rows must be in the cache"
    # [G, L, H, Dn], [G, L, P], [G, L, H, Dv]
    k_nope, k_pe, v = expand_history(kv_cache, w_uk, w_uv, q_nope.dtype)
    # [G, H, *, *]: torch's fused kernels take 4-D inputs only; 3-D ones went to the math path, which runs bf16
    # in fp32 GEMMs and a [H, T, L] softmax (session 43's engine prefill profile: 14 of its 66 ms at 8 x 1024).
    # Dv != Dn + P, so on CUDA the memory-efficient kernel takes them (flash needs v as wide as q and k)
    k_nope, v = k_nope.transpose(1, 2), v.transpose(1, 2)
    k = torch.cat([k_nope, k_pe[:, None].expand(G, H, L, P)], dim=-1)  # [G, H, L, Dn + P]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [G, H, T, Dn + P]
    if T == L:  # a chunk from position 0: plain causal attention
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # after a cached prefix: query t (position L - T + t) sees rows 0..L - T + t
        visible = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)  # [T, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    o = o.transpose(1, 2)  # [G, T, H, Dv]
    return o if batched else o[0]
