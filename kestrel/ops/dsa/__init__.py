import torch

from kestrel.env import env_field
from kestrel.ops.dsa.naive import (
    indexer_kl,
    indexer_scores,
    indexer_scores_batched,
    selection_mask,
    topk_select,
)


def fast_topk(device: torch.device):
    """The exact top-k kernel for scores on `device`, (scores, lens, k) -> [B, k] positions in ascending order:
    the CUDA kernel (cuda_topk) on CUDA where nvcc builds it, else Triton's (triton_topk); KESTREL_DSA_TOPK
    picks one. Both select what naive.topk_select selects."""
    choice = env_field("dsa_topk")
    if device.type == "cuda" and choice != "triton":
        from kestrel.ops.dsa import cuda_topk

        if cuda_topk.available():
            return cuda_topk.topk_cuda
        if choice == "cuda":
            raise RuntimeError(
                f"KESTREL_DSA_TOPK=cuda, but the CUDA top-k is unavailable: {cuda_topk.UNAVAILABLE_REASON}"
            )
    from kestrel.ops.dsa.triton_topk import topk_triton

    return topk_triton


__all__ = [
    "fast_topk",
    "indexer_kl",
    "indexer_scores",
    "indexer_scores_batched",
    "selection_mask",
    "topk_select",
]
