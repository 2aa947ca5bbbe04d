import warnings

import torch

from kestrel.env import env_field
from kestrel.ops.dsa.naive import (
    by_position,
    indexer_kl,
    indexer_scores,
    indexer_scores_batched,
    keep_selected_,
    selection_mask,
    topk_select,
)


def fast_topk(device: torch.device):
    """The exact top-k kernel for scores on `device`, (scores, lens, k) -> [B, k] positions in ascending order.
    On CUDA by KESTREL_DSA_TOPK: auto (the default) the CUDA kernel (cuda_topk) where it builds and passes its
    probe, else Triton's (triton_topk), with one warning that says why; cuda the CUDA kernel or an error; triton
    Triton's. Elsewhere Triton's (the interpreter on CPU). All select what naive.topk_select selects. On the H200
    (2026-12-01, session 19) the CUDA kernel took 43.2 us for 64 x 131072 scores, k = 2048, against Triton's 134
    and torch.topk's 192.5 (4.46x), and 0.55-0.68x Triton's time at the prefill and training shapes."""
    choice = env_field("dsa_topk")
    if device.type == "cuda" and choice in ("auto", "cuda"):
        from kestrel.ops.dsa import cuda_topk

        if cuda_topk.available():
            return cuda_topk.topk_cuda
        if choice == "cuda":
            raise RuntimeError(
                f"KESTREL_DSA_TOPK=cuda, but the CUDA top-k is unavailable: {cuda_topk.UNAVAILABLE_REASON}"
            )
        _warn_fallback(cuda_topk.UNAVAILABLE_REASON)
    from kestrel.ops.dsa.triton_topk import topk_triton

    return topk_triton


def topk_with_rows(kernel):
    """Where KESTREL_DSA_TOPK_ROWS=on and decode's top-k `kernel` (`fast_topk`'s pick) is the CUDA one:
    `cuda_topk.topk_cuda_with_rows` (scores, lens, k, page_table, page_size) -> (positions, pool rows or None),
    the rows made in the top-k's own launch where its pick is a short variant (a choice by the scores' shape and
    alignment only: CUDA-graph safe). Else None: the top-k alone, its positions translated by the sparse MLA."""
    if env_field("dsa_topk_rows") != "on":
        return None
    from kestrel.ops.dsa import cuda_topk

    return cuda_topk.topk_cuda_with_rows if kernel is cuda_topk.topk_cuda else None


_warned = False  # auto's fallback warning is given once a process


def _warn_fallback(reason: str | None) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"the CUDA DSA top-k is unavailable ({reason}); using Triton's (the same selection, ~2x slower). "
            "Set KESTREL_DSA_TOPK=triton to choose it and silence this.",
            RuntimeWarning,
            stacklevel=3,
        )


__all__ = [
    "by_position",
    "fast_topk",
    "indexer_kl",
    "indexer_scores",
    "indexer_scores_batched",
    "keep_selected_",
    "selection_mask",
    "topk_select",
    "topk_with_rows",
]
