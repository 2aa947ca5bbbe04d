"""`kestrel bench kernels`, sampling: greedy decoding's argmax over the vocabulary, against torch.argmax."""

from __future__ import annotations

import torch

from kestrel.bench.measure import kernel_row
from kestrel.bench.roofline import time_ms


def bench_greedy(ceilings: dict, batch: int, vocab: int = 129280, device: str = "cuda") -> dict:
    """The argmax of a decode step's fp32 logits [batch, vocab] (mini's vocabulary); peer: torch.argmax."""
    from kestrel.ops.sampling.triton_greedy import greedy_triton

    logits = torch.randn(batch, vocab, device=device)
    ms = time_ms(lambda: greedy_triton(logits), device)
    peer_ms = time_ms(lambda: torch.argmax(logits, dim=-1), device)
    same = torch.equal(greedy_triton(logits), torch.argmax(logits, dim=-1))
    return kernel_row(
        f"greedy argmax B={batch} V={vocab}",
        ms,
        logits.numel() * 4 + batch * 8,
        logits.numel(),
        ceilings,
        peer="torch.argmax",
        peer_ms=peer_ms,
        same_ids_as_peer=same,
    )
