"""Sampling: logits processing (penalties, logit bias and allowed tokens, temperature, top-k, top-p, min-p) and
seeded sampling that does not depend on the batch. Batched over rows, each row with its own parameters; no host
syncs.

Legend: B rows (requests), V vocabulary.

A request with seed s draws its token at output step j as argmax(p / E), E[v] ~ Exp(1) (the exponential race,
an exact sample of p). E is a pure function of (s, j, v): a counter-based integer hash, computed on the device,
so the same seed gives the same tokens whatever else is in the batch, on any path, CPU or GPU.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply), on int64 tensors holding 32-bit values (no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """E [B, V] fp32, Exp(1) variates that depend only on (seeds[b], steps[b], v). seeds, steps: [B] int64."""
    device = seeds.device
    s = seeds.long()
    key = _mix32((s & _MASK32) ^ _mix32((s >> 32) & _MASK32))  # [B]
    key = _mix32(key ^ _mix32(steps.long() & _MASK32))  # [B]
    v = torch.arange(vocab, device=device, dtype=torch.int64)  # [V]
    bits = _mix32(_mix32(key[:, None] ^ v[None, :]) ^ (key[:, None] >> 7))  # [B, V]
    u = (bits.double() + 0.5) / 2.0**32  # (0, 1)
    return (-torch.log(u)).float()


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalties on fp32 logits [B, V].

    output_counts [B, V]: occurrences of each token in the output so far; seen [B, V] bool: in prompt or output.
    repetition [B] (HF/vLLM): seen tokens' logits are divided by it when positive, multiplied when negative.
    frequency, presence [B] (OpenAI): logit -= frequency * count + presence * (count > 0).
    """
    x = logits.float()
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = output_counts.float()
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """fp32 logits [B, V] -> probabilities [B, V] after temperature, top-k, top-p and min-p, per row.

    temperature [B] > 0 (greedy rows are the caller's business: give them 1.0); top_k [B] int (0 = off);
    top_p [B] (1 = off); min_p [B] (0 = off). Ties at the top-k / top-p cut keep every tied token; each row keeps
    at least its most likely token. The cuts compare logits, not probabilities: a softmax of the sorted logits
    sums in another order than one of the unsorted, and compared with each other the last kept token could fall
    below its own cut (a row with one token kept then had none, and sampled token 0). A +inf logit (a repetition
    penalty near 0 divides by it) counts as the largest finite one, a NaN as -inf.
    """
    x = logits.float() / temperature[:, None]
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    V = x.shape[-1]
    sorted_x, _ = x.sort(dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))  # [B]
    kth = sorted_x.gather(1, (k - 1).long()[:, None])  # [B, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sorted_p = torch.softmax(sorted_x, dim=-1)  # [B, V] descending
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each sorted entry
    keep_sorted = before < top_p[:, None]  # the smallest prefix whose mass reaches top_p
    n_keep = keep_sorted.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    cut = torch.maximum(sorted_x.gather(1, n_keep - 1), kth)  # [B, 1] the logit of the last kept entry
    probs = torch.softmax(x.masked_fill(x < cut, float("-inf")), dim=-1)
    probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Token ids [B] drawn from probs [B, V] with each row's (seed, step) noise."""
    return torch.argmax(probs / exponential_noise(seeds, steps, probs.shape[-1]), dim=-1)


def apply_penalties_at(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """`apply_penalties` computed only where it changes anything: at the seen tokens (rows[i], cols[i]), every
    token of each row's prompt and output, repeats allowed (each writes the same value), instead of over [B, V]
    with a dense seen mask (ten passes over the rows: on the H200 1041 us at 256 rows of mini's vocabulary, against
    288 here; session 42). A new fp32 tensor; the same values (a column that is not seen keeps its logit, where
    `apply_penalties` subtracts zeros from it: equal, except that -0.0 may come out +0.0 there)."""
    x = logits.to(torch.float32, copy=True)
    v = x[rows, cols]
    rep = repetition[rows]
    v = torch.where(v > 0, v / rep, v * rep)
    counts = output_counts[rows, cols].float()
    x[rows, cols] = v - frequency[rows] * counts - presence[rows] * (counts > 0).float()
    return x


def steer_logits(
    logits: torch.Tensor,
    bias_rows: torch.Tensor,
    bias_cols: torch.Tensor,
    bias: torch.Tensor,
    restricted: torch.Tensor,
    allowed_rows: torch.Tensor,
    allowed_cols: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's logit_bias, then vLLM's allowed_token_ids, on logits [B, V]: a new fp32 tensor.

    bias [N] is added at (bias_rows, bias_cols) (each pair once); in the rows where restricted [B] (bool) is set,
    every column but the (allowed_rows, allowed_cols) pairs becomes -inf."""
    x = logits.to(torch.float32, copy=True)
    x.index_put_((bias_rows, bias_cols), bias.float(), accumulate=True)
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    keep.index_put_((allowed_rows, allowed_cols), torch.ones((), dtype=torch.bool, device=x.device))
    return x.masked_fill(restricted[:, None] & ~keep, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprobs of logits [B, V] (fp32 log_softmax): each row's tokens[b]'s [B], and its top k (values
    [B, k], ids [B, k] int64)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    return lp.gather(1, tokens[:, None])[:, 0], top_v, top_i


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; ties go to the lowest token id."""
    return torch.argmax(logits, dim=-1)
