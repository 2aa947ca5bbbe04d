"""Training attention over row-packed documents through FlexAttention: only the key blocks a query block can see.

Legend: B rows, R tokens a row, H heads, Dq = Dn + P query/key width, Dv value width.

`naive.mla_attention_rows` hands scaled_dot_product_attention a dense [B, R, R] visibility mask, and the fused
kernel (cuDNN on the H200) computes every query against every key of the row: for the demo's 8 rows of 8704 tokens
holding ~290 documents, ~37 ms of a 169 ms training step (forward and backward, two MLA layers, session 11), most
of it on pairs of tokens in different documents. FlexAttention builds a block mask from the same visibility (its
128 x 128 blocks with no visible pair are skipped, the partly visible ones masked) and computes only those.
The mask is the same tensor, so dense warm-up and sparse DSA training (the top-k narrowed mask) both run here.
The block mask is read off the dense mask with two reductions (`block_mask_from_dense`), not by
`create_block_mask`: that compiles a kernel of its own, whose cold compile can take minutes at some lengths
(pytorch/pytorch#182060), and session 11's two GPU runs of this path never ended their first step (140-170 s).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask_from_dense(allowed: torch.Tensor, block: int, mask_mod):
    """The BlockMask of a dense visibility [B, R, R] (R a multiple of `block`): per (row, query block) the key
    blocks with every pair visible (computed without the mask) and those with some (mask_mod decides each pair),
    in key order."""
    from torch.nn.attention.flex_attention import BlockMask

    B, R = allowed.shape[0], allowed.shape[1]
    n = R // block
    tiles = allowed.view(B, n, block, n, block)
    some = tiles.any(4).any(2)  # [B, n, n] query block x key block
    full = tiles.all(4).all(2)

    def listing(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(-1, dtype=torch.int32)  # [B, n]
        order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # listed first
        return counts[:, None], order[:, None]  # [B, 1, n], [B, 1, n, n] (one head: the mask is per row)

    kv_num, kv_idx = listing(some & ~full)
    full_num, full_idx = listing(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(R, R)
    )


def flex_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    compiled: bool = True,
    block: int = 128,
    kernel_options: dict | None = None,
) -> torch.Tensor:
    """q, k [B, H, R, Dq], v [B, H, R, Dv], allowed [B, R, R] bool (query t may see key s; every query at least
    itself) -> o [B, H, R, Dv] in q.dtype: softmax(q k^T * scale, masked to `allowed`) v. compiled=False runs
    flex's eager form (the CPU tests; slow, no fused kernel). kernel_options: flex's tiles, warps and stages
    (`fwd_`/`bwd_` prefixed; scripts/bench_train_attention.py times them); None: `tuned_options`; {}: torch's."""
    from torch.nn.attention.flex_attention import flex_attention

    R = allowed.shape[1]
    if R % block:  # the block mask's padding would read `allowed` past its end
        raise ValueError(f"flex_attention_rows: row length {R} is not a multiple of the block {block}")

    def visible(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    mask = block_mask_from_dense(allowed, block, visible)
    attend = _compiled() if compiled else flex_attention
    options = tuned_options(q, v) if kernel_options is None else kernel_options
    return attend(q, k, v, block_mask=mask, scale=scale, kernel_options=options or None)


# The backward's tiles on the H200 (sm90) for query/key widths of 129-192 and value widths up to 128: dk/dv in
# 32 x 128 tiles, dq in 128 x 32, 3 stages, 8 warps. At mini's widths (192, 128; 16 heads, 2 rows of 8704 tokens
# of the training mixture) forward and backward took 6.4 ms against 10.2 ms with torch's default (64 x 64 tiles,
# 2 stages, 4 warps) and 24.0 ms for the dense masked SDPA; at the demo's (96, 64; 6 heads, 8 rows) 8.9 ms against
# torch's 8.3 ms, so narrower heads keep torch's (scripts/bench_train_attention.py, session 28). At mini's widths
# 64 x 128 tiles fit in 2 stages (6.6 ms), not in 3, nor do 128 x 128 forward tiles (227 KB of shared memory).
# bf16 / fp16 only: torch keeps fp32 to 16 x 16 tiles in one stage.
_SM90_BWD = {
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 128,
    "bwd_BLOCK_M2": 128,
    "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 3,
    "bwd_num_warps": 8,
}


def tuned_options(q: torch.Tensor, v: torch.Tensor) -> dict:
    """The kernel options timed fastest for these widths on this GPU ({}: torch's defaults)."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if (
            torch.cuda.get_device_capability(q.device) == (9, 0)
            and 128 < q.shape[-1] <= 192
            and v.shape[-1] <= 128
        ):
            return dict(_SM90_BWD)
    return {}
