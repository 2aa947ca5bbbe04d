"""DeepSeek sparse attention (DSA) lightning indexer and exact top-k references (model-spec 2.3, 2.5).

Legend: T queries of one sequence, L cached tokens, HI indexer heads, DI indexer head dim, k = index_topk;
B sequences with caches padded to Lmax tokens in the batched decode form.
The single tie rule used everywhere in Kestrel: higher score first; equal scores -> lower position first.
Candidates of the query at position p are positions 0..p (causal, itself included); when fewer than k are
visible, all visible positions are selected. NaN scores count as invalid (never selected).
"""

from __future__ import annotations

import torch


def indexer_scores(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, scale: float
) -> torch.Tensor:
    """I[t, s] = sum_j weights[t, j] * relu(q_idx[t, j] . k_idx[s]) * scale, in fp32.

    q_idx [T, HI, DI], k_idx [L, DI], weights [T, HI] (the layer folds HI ** -0.5 into them),
    scale = DI ** -0.5. Returns [T, L] fp32 (no causal mask applied).
    One head at a time: a [T, HI, L] intermediate would be 17 GB for a 2K-token prefill chunk at 128K context.
    """
    k = k_idx.float().t()  # [DI, L]
    scores = None
    for j in range(q_idx.shape[1]):
        term = torch.relu(q_idx[:, j].float() @ k) * weights[:, j, None].float()  # [T, L]
        scores = term if scores is None else scores + term
    return scores * scale


def indexer_scores_batched(
    q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, scale: float
) -> torch.Tensor:
    """`indexer_scores` for one query per sequence over B padded key caches (decode).

    q_idx [B, HI, DI], k_idx [B, Lmax, DI], weights [B, HI]. Returns [B, Lmax] fp32. Padded positions get
    whatever their garbage keys give; `topk_select` with q_pos = lens - 1 never selects them.
    """
    logits = torch.einsum("bjd,bsd->bjs", q_idx.float(), k_idx.float())  # [B, HI, Lmax]
    scores = torch.einsum("bj,bjs->bs", weights.float(), torch.relu(logits))  # [B, Lmax]
    return scores * scale


def topk_select(scores: torch.Tensor, q_pos: torch.Tensor, k: int) -> torch.Tensor:
    """Exact causal top-k with the tie rule above.

    scores [T, L] fp32, q_pos [T] int64 (query t sees positions 0..q_pos[t]).
    Returns indices [T, k] int64: the selected positions in rank order (best first), -1 in unused slots.

    Only NaN and the causal mask make a position invalid. An infinite score is a real score: +inf ranks
    above every finite one and -inf below every finite one, but a valid -inf still beats any invalid position.
    Equal scores compare by IEEE equality (so -0.0 ties with +0.0) and fall back to the lower position.
    Row-wise and free of host syncs, so it also serves batched decode: rows = sequences, q_pos = lens - 1.
    """
    T, L = scores.shape
    pos = torch.arange(L, device=scores.device)  # [L]
    valid = (pos[None, :] <= q_pos[:, None]) & ~torch.isnan(scores)  # [T, L]
    key = scores.masked_fill(~valid, float("-inf"))  # [T, L]
    # A stable sort keeps position order inside every group of equal scores: the tie rule.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [T, L]
    # Invalid entries share -inf with valid -inf scores; a second stable sort moves every valid entry first
    # while keeping the (score desc, position asc) order among valid entries.
    regroup = torch.sort(valid.gather(1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
    order = order.gather(1, regroup)  # [T, L] valid entries first, best first
    n = min(k, L)
    top = order[:, :n]  # [T, n]
    top = torch.where(valid.gather(1, top), top, -1)  # [T, n]
    if k > n:
        top = torch.cat([top, top.new_full((T, k - n), -1)], dim=1)  # [T, k]
    return top


def by_position(indices: torch.Tensor) -> torch.Tensor:
    """A selection [T, k] (-1 in unused slots) listed in ascending position order, -1 last: topk_select's rank
    order in the order the fast kernels list it."""
    big = torch.iinfo(torch.int64).max
    listed = torch.where(indices < 0, big, indices).sort(-1).values
    return torch.where(listed == big, -1, listed)


def check_selection(indices: torch.Tensor, length: int) -> None:
    """That every entry of a selection is a position in [0, length) or the -1 padding. Checked on the device
    without a host sync (sparse training checks each row's): on CUDA a failure is a device-side assert, reported
    at a later sync and fatal to the process; on the CPU a RuntimeError at once."""
    torch._assert_async(((indices >= -1) & (indices < length)).all(), "selection index out of range")


def selection_mask(indices: torch.Tensor, length: int) -> torch.Tensor:
    """indices [T, k] (-1 = unused) -> bool mask [T, length], True at selected positions."""
    check_selection(indices, length)
    T = indices.shape[0]
    mask = torch.zeros(T, length + 1, dtype=torch.bool, device=indices.device)  # [T, length + 1]
    # The extra column `length` soaks up the -1 padding.
    mask.scatter_(1, torch.where(indices < 0, length, indices).long(), True)
    return mask[:, :length]  # [T, length]


def keep_selected_(mask: torch.Tensor, picks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """In place: row picks[m] of mask [N, L] (bool) keeps only those of its True positions that indices[m] lists
    ([M, k], -1 = unused); the other rows are left as they are. Sparse training's narrowing of a row's
    visibility to the DSA selection. Returns mask."""
    mask[picks] = mask[picks] & selection_mask(indices, mask.shape[1])
    return mask


def indexer_kl(attn_probs: torch.Tensor, index_scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The DSA indexer's training loss (DeepSeek-V3.2): KL(p || softmax(I)) per query, summed over queries.

    attn_probs [Q, H, L]: the main attention's probabilities of Q queries (rows sum to 1 over allowed keys);
    the target p is their head-sum, L1-normalized. index_scores [Q, L] (fp32), allowed [Q, L] bool: the keys
    both distributions range over (visible keys in the dense warm-up, the selected ones in sparse training).
    """
    p = attn_probs.float().sum(1).masked_fill(~allowed, 0.0)  # [Q, L]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    log_q = torch.log_softmax(index_scores.float().masked_fill(~allowed, float("-inf")), dim=-1)  # [Q, L]
    terms = torch.where(allowed & (p > 0), p * (torch.log(p.clamp_min(1e-20)) - log_q), torch.zeros_like(p))
    return terms.sum()
