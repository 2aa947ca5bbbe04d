import torch

from kestrel.env import env_field
from kestrel.ops.dsa.naive import (
    by_position,
    indexer_kl,
    indexer_scores,
    indexer_scores_batched,
    selection_mask,
    topk_select,
)


def fast_topk(device: torch.device):
    """The exact top-k kernel for scores on `device`, (scores, lens, k) -> [B, k] positions in ascending order:
    Triton's (triton_topk), or with KESTREL_DSA_TOPK=cuda on CUDA the CUDA kernel (cuda_topk: 3.4x torch.topk on
    the H200 against Triton's 1.6x, but its committed source has not run on a GPU yet; `auto` moves to it once it
    has). Both select what naive.topk_select selects."""
    choice = env_field("dsa_topk")
    if device.type == "cuda" and choice == "cuda":
        from kestrel.ops.dsa import cuda_topk

        if cuda_topk.available():
            return cuda_topk.topk_cuda
        raise RuntimeError(
            f"KESTREL_DSA_TOPK=cuda, but the CUDA top-k is unavailable: {cuda_topk.UNAVAILABLE_REASON}"
        )
    from kestrel.ops.dsa.triton_topk import topk_triton

    return topk_triton


__all__ = [
    "by_position",
    "fast_topk",
    "indexer_kl",
    "indexer_scores",
    "indexer_scores_batched",
    "selection_mask",
    "topk_select",
]
