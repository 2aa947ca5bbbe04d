"""`kestrel bench kernels`: the KDA kernels (the decode step on the state slots, the prefill short conv)."""

from __future__ import annotations

import torch

from kestrel.bench.measure import kernel_row, time_configs
from kestrel.bench.roofline import time_ms


def bench_kda_decode(
    ceilings: dict, batch: int, heads: int = 8, dim: int = 128, device: str = "cuda"
) -> dict:
    from kestrel.ops.kda import get_kda_backend

    # the step the decode path runs (on CUDA, ours unless KESTREL_KDA_DECODE=fla)
    recurrent_inplace = get_kda_backend(torch.device(device)).recurrent_inplace
    pool = torch.randn(batch + 1, heads, dim, dim, device=device) * 0.05
    slots = torch.arange(1, batch + 1, device=device)
    q, k, v = (torch.randn(batch, 1, heads, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(batch, 1, heads, dim, device=device)
    beta = torch.rand(batch, 1, heads, device=device)
    ms = time_ms(lambda: recurrent_inplace(q, k, v, g, beta, pool, slots, use_qk_l2norm=True), device)
    nbytes = 2 * batch * heads * dim * dim * 4
    return kernel_row(
        f"KDA decode in place N={batch} H={heads}", ms, nbytes, 4 * batch * heads * dim * dim, ceilings
    )


def bench_kda_conv_prefill(
    ceilings: dict, tokens: int, seqs: int = 8, channels: int = 3072, width: int = 4232, device: str = "cuda"
) -> dict:
    """The KDA short conv of a packed prefill (Triton, kestrel.ops.kda.triton_conv.short_conv_prefill) at mini's
    sizes: q|k|v channels read as a column slice of the merged input projection's rows (`width` wide), `seqs`
    sequences packed, no prior state. The default tile, then a sweep of tiles; bytes: x read and y written."""
    from kestrel.ops.kda.triton_conv import short_conv_prefill

    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)[:, :channels]
    weight = torch.randn(channels, 4, device=device, dtype=torch.bfloat16)
    cu = torch.linspace(0, tokens, seqs + 1, device=device).long()
    ref = short_conv_prefill(x, weight, None, cu)[0].float()
    tiles = ((16, 256, 4), (64, 128, 4), (32, 128, 8), (16, 512, 8), (8, 256, 2), (16, 128, 2))
    sweep = time_configs(
        {
            f"block_t{bt}_block_c{bc}_warps{w}": lambda bt=bt, bc=bc, w=w: short_conv_prefill(
                x, weight, None, cu, block_t=bt, block_c=bc, num_warps=w
            )
            for bt, bc, w in tiles
        },
        device,
        "max_abs_vs_default",
        lambda fn: float((fn()[0].float() - ref).abs().max()),
    )
    ms = sweep["block_t16_block_c256_warps4"]["ms"]
    # as the engine calls it: each sequence's conv state (its last W - 1 inputs) from the state pool
    state = torch.randn(seqs, channels, 3, device=device, dtype=torch.bfloat16)
    with_state = time_ms(lambda: short_conv_prefill(x, weight, state, cu), device)
    return kernel_row(
        f"KDA conv prefill T={tokens} C={channels}",
        ms,
        2 * tokens * channels * 2,
        0,
        ceilings,
        sweep=sweep,
        with_state_ms=with_state,
    )
