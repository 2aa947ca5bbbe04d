"""Dense MLA prefill through torch's fused attention (`F.scaled_dot_product_attention`): the fast path of
`naive.mla_attention_absorbed` without a DSA selection, for a prefill chunk whose queries are the last T of the
L cached tokens (positions L - T .. L - 1).

The absorbed form is the decode form: for a prefill chunk it multiplies in the R-wide latent space (R = 512 with
P = 64 against Dn + P = 192 and Dv = 128 expanded), in fp32, and materializes [T, H, L] scores. Here keys and
values are expanded once per chunk (W_UK and W_UV on the latent rows) and attention runs in the input dtype in
one fused kernel (flash or memory-efficient on CUDA). Legend as in naive.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mla_prefill_sdpa(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_pe [T, H, P] of the chunk's tokens, the last T of kv_cache [L, R + P]; w_uk [H, Dn, R],
    w_uv [H, Dv, R]. Returns o [T, H, Dv] in q_nope.dtype: each query attends causally to rows 0..its position."""
    T, H, _ = q_nope.shape
    P = q_pe.shape[-1]
    L = kv_cache.shape[0]
    assert T <= L, f"{T} queries over {L} cached rows: the chunk's own rows must be in the cache"
    dt = q_nope.dtype
    c_kv, k_pe = kv_cache.to(dt).split([kv_cache.shape[1] - P, P], dim=-1)  # [L, R], [L, P]
    k_nope = torch.einsum("lr,hdr->hld", c_kv, w_uk.to(dt))  # [H, L, Dn]
    v = torch.einsum("lr,hdr->hld", c_kv, w_uv.to(dt))  # [H, L, Dv]
    k = torch.cat([k_nope, k_pe[None].expand(H, L, P)], dim=-1)  # [H, L, Dn + P]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, T, Dn + P]
    if T == L:  # a chunk from position 0: plain causal attention
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # after a cached prefix: query t (position L - T + t) sees rows 0..L - T + t
        visible = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)  # [T, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return o.transpose(0, 1)  # [T, H, Dv]
