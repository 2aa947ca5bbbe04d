from kestrel.ops.dsa.naive import indexer_scores, selection_mask, topk_select

__all__ = ["indexer_scores", "selection_mask", "topk_select"]
