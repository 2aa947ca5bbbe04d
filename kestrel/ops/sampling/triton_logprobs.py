"""The logprobs a request asks for, of some rows of logits [B, V], in two Triton kernels: `naive.token_logprobs`
(torch.log_softmax, then the sampled token's value and the top k) without the [b, V] fp32 copy and
log_softmax's [b, V] output, each of them a full pass over the rows at the copy rate and then some.

Legend: B rows, b of them asked for, V vocabulary, C chunks of BV a row, k the top logprobs asked (<= 20).

The first kernel's program (j, c) reads chunk c of row rows[j] once: its max m_c and sum of exp(x - m_c), and its
k best columns (the argmax kernel's int64 keys, `triton_argmax._packed`: the value's key above its column
reversed, so the first column wins ties; k maxima, each one masked out once found). The second's program j adds the
chunks' sums (s = sum_c s_c exp(m_c - m), m the row's max; one fixed reduction: the same bits every run) and takes
the row's k best of the C x k candidates; each value is (x - m) - log(s), torch's log_softmax form, from x read
again at its column.
Against torch the values differ by the sum's order and the exponent's approximation (a few ulps of fp32; torch's
own CPU log_softmax is ~1e-5 off an fp64 one at 129K columns, these kernels ~1e-7); ties in the top k go to the
first column (torch.topk leaves their order unspecified).

On the H200 (session 42, scripts/decode_kernels_check.py --sections sampling; mini's 129,280-token vocabulary,
bf16 logits, one call a graph replay), us at 1 / 64 / 256 rows, top 5: **12.9 / 46.3 / 147.5** against torch's
104.2 / 226.8 / 679.5 (the logits' bytes at the copy rate: 0.06 / 3.9 / 15.5); top 20: 24.3 / 131.1 / 442.0
against 104.8 / 228.6 / 679.4 (the k maxima a chunk are the cost). Chunks of 2048 were the best or level at every
batch (4096: 13.9 / 53.0 / 147.6; 8192: 16.2 / 51.2 / 149.0). In `kestrel bench decode --sampling logprobs`
(mini, 4K, top 5 on every row), the step with the overlap schedule: batch 1 1.60 -> **1.47 ms**, batch 256 7.09 ->
**6.46 ms** (greedy's: 1.47 and 6.39 ms; at 256 rows the chunks were 8192 wide then, the argmax's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_begin
from kestrel.ops.sampling.triton_argmax import _column, _packed

MAX_TOP = 20  # the most top logprobs a row may ask (SamplingParams' limit, OpenAI's)
BV = 2048  # a chunk's width


@triton.jit
def _chunk_kernel(
    x, rows, stats, cand, V, C, k, stride, KMAX: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (j, c): chunk c of row rows[j] (ROWS; else row j): stats[j, c] = (max, sum of exp(x - max));
    cand[j, c, :k] its k best as int64 keys, best first (the lowest key where the chunk has fewer than k
    columns)."""
    pdl_begin(PDL)
    j = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    r = j
    if ROWS:
        r = tl.load(rows + j)
    cols = c * BV + tl.arange(0, BV)
    live = cols < V
    v = tl.load(x + r * stride + cols, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.max(v, axis=0)
    s = tl.sum(tl.where(live, tl.exp(v - m), 0.0), axis=0)
    s = tl.where(m == float("-inf"), 0.0, s)  # every column -inf: nothing to add (not -inf - -inf)
    tl.store(stats + (j * C + c) * 2, m)
    tl.store(stats + (j * C + c) * 2 + 1, s)
    packed = _packed(v, cols, live)
    for i in range(0, k):
        best = tl.max(packed, axis=0)
        tl.store(cand + (j * C + c) * KMAX + i, best)
        packed = tl.where(packed == best, -9223372036854775807 - 1, packed)


@triton.jit
def _rows_kernel(
    x, rows, tokens, stats, cand, chosen, top_v, top_i, C, k, stride,
    KMAX: tl.constexpr, BC: tl.constexpr, BQ: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program j: row r = rows[j]'s (ROWS; else j's) log-sum-exp from its chunks', the sampled token's logprob
    (tokens[r]) and the k best of the C x k candidates with theirs."""
    pdl_begin(PDL)
    j = tl.program_id(0).to(tl.int64)
    r = j
    if ROWS:
        r = tl.load(rows + j)
    cs = tl.arange(0, BC)
    m_c = tl.load(stats + (j * C + cs) * 2, mask=cs < C, other=float("-inf"))
    s_c = tl.load(stats + (j * C + cs) * 2 + 1, mask=cs < C, other=0.0)
    m = tl.max(m_c, axis=0)
    log_s = tl.log(tl.sum(tl.where(cs < C, s_c * tl.exp(m_c - m), 0.0), axis=0))
    row = x + r * stride
    tok = tl.load(tokens + r)
    tl.store(chosen + j, (tl.load(row + tok).to(tl.float32) - m) - log_s)
    q = tl.arange(0, BQ)  # candidate q: chunk q // KMAX, rank q % KMAX
    packed = tl.load(
        cand + j * C * KMAX + q, mask=(q < C * KMAX) & (q % KMAX < k), other=-9223372036854775807 - 1
    )
    for i in range(0, k):
        best = tl.max(packed, axis=0)
        col = _column(best)
        tl.store(top_i + j * k + i, col)
        tl.store(top_v + j * k + i, (tl.load(row + col).to(tl.float32) - m) - log_s)
        packed = tl.where(packed == best, -9223372036854775807 - 1, packed)


def token_logprobs_triton(
    x: torch.Tensor, tokens: torch.Tensor, k: int, rows: torch.Tensor | None = None, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, V] logits (fp32, bf16 or fp16; rows contiguous), tokens [B] (each row's sampled token, in [0, V): not
    checked, that would wait for the device), k in [0, MAX_TOP] and <= V, rows [b] on x's device (the rows asked
    for; None: all). Returns (chosen [b], top values [b, k], both fp32, top ids [b, k] int64):
    `naive.token_logprobs(x[rows], tokens[rows], k)`. block: a chunk's width (a power of two; None: BV)."""
    assert x.dim() == 2 and x.stride(-1) == 1, (
        f"logits {tuple(x.shape)} with stride {x.stride()}: rows [B, V]"
    )
    B, V = x.shape
    assert 0 <= k <= min(MAX_TOP, V), f"top {k} logprobs of {V} columns: at most {MAX_TOP}"
    assert tokens.shape == (B,), f"tokens {tuple(tokens.shape)}: one a row of {B}"
    # the kernels read both as int64 at stride 1 (no rows: every row, read in place)
    tokens = tokens.to(torch.int64).contiguous()
    picked = rows is not None
    rows = rows.to(torch.int64).contiguous() if picked else tokens  # (tokens: a stand-in, never read)
    b = rows.numel() if picked else B
    dev = x.device
    chosen = torch.empty(b, dtype=torch.float32, device=dev)
    top_v = torch.empty(b, k, dtype=torch.float32, device=dev)
    top_i = torch.empty(b, k, dtype=torch.int64, device=dev)
    if b == 0:
        return chosen, top_v, top_i
    block = block or BV
    C = triton.cdiv(V, block)
    stats = torch.empty(b, C, 2, dtype=torch.float32, device=dev)
    cand = torch.empty(b, C, MAX_TOP, dtype=torch.int64, device=dev)
    pdl = pdl_args(chosen)
    _chunk_kernel[(b, C)](
        x, rows, stats, cand, V, C, k, x.stride(0), KMAX=MAX_TOP, BV=block, ROWS=picked, num_warps=4, **pdl
    )
    _rows_kernel[(b,)](
        x, rows, tokens, stats, cand, chosen, top_v, top_i, C, k, x.stride(0), KMAX=MAX_TOP,
        BC=triton.next_power_of_2(C), BQ=triton.next_power_of_2(C * MAX_TOP), ROWS=picked, num_warps=4, **pdl,
    )  # fmt: skip
    return chosen, top_v, top_i
