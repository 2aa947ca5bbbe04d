"""Training attention over row-packed documents through FlexAttention: only the key blocks a query block can see.

Legend: B rows, R tokens a row, H heads, Dq = Dn + P query/key width, Dv value width.

`naive.mla_attention_rows` hands scaled_dot_product_attention a dense [B, R, R] visibility mask, and the fused
kernel (cuDNN on the H200) computes every query against every key of the row: for the demo's 8 rows of 8704 tokens
holding ~290 documents, ~37 ms of a 169 ms training step (forward and backward, two MLA layers, session 11), most
of it on pairs of tokens in different documents. FlexAttention builds a block mask from the same visibility (its
128 x 128 blocks with no visible pair are skipped, the partly visible ones masked) and computes only those.
The mask is the same tensor, so dense warm-up and sparse DSA training (the top-k narrowed mask) both run here.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    compiled: bool = True,
    block: int = 128,
) -> torch.Tensor:
    """q, k [B, H, R, Dq], v [B, H, R, Dv], allowed [B, R, R] bool (query t may see key s; every query at least
    itself) -> o [B, H, R, Dv] in q.dtype: softmax(q k^T * scale, masked to `allowed`) v. compiled=False runs
    flex's eager form (the CPU tests; slow, no fused kernel)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, R = allowed.shape[0], allowed.shape[1]
    if R % block:  # the block mask's padding would read `allowed` past its end
        raise ValueError(f"flex_attention_rows: row length {R} is not a multiple of the block {block}")

    def visible(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    mask = create_block_mask(visible, B, None, R, R, device=q.device, BLOCK_SIZE=block, _compile=compiled)
    attend = _compiled() if compiled else flex_attention
    return attend(q, k, v, block_mask=mask, scale=scale)
