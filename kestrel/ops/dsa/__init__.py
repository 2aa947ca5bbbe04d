from kestrel.ops.dsa.naive import (
    indexer_kl,
    indexer_scores,
    indexer_scores_batched,
    selection_mask,
    topk_select,
)

__all__ = ["indexer_kl", "indexer_scores", "indexer_scores_batched", "selection_mask", "topk_select"]
