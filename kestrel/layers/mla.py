"""Gated multi-head latent attention (NoPE, as in Kimi) with an optional DSA lightning indexer.

Legend: T packed tokens, H heads (local), R kv_lora_rank, Pr rope dims (scored, never rotated), Dn nope dims,
Dv value dims, HI/DI indexer heads/dim, L cached tokens of one sequence.
Per token the cache keeps the latent row [c_kv (R) | k_pe (Pr)] and, with DSA, one indexer key [DI].
"""

from __future__ import annotations

import itertools
from functools import partial

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.env import env_field
from kestrel.layers.context import get_forward_context
from kestrel.layers.indexer import LATENT_NORM_EPS, Indexer
from kestrel.layers.linear import ColumnLinear, Linear, RowLinear, apply_many
from kestrel.layers.norm import RMSNorm
from kestrel.ops.activation import sigmoid_gate
from kestrel.ops.dsa import (
    fast_topk,
    indexer_kl,
    indexer_scores,
    indexer_scores_batched,
    keep_selected_,
    topk_select,
    topk_with_rows,
)
from kestrel.ops.linear import fused_gemv_applies, linear_gated
from kestrel.ops.mla import mla_attention_absorbed, mla_attention_rows, mla_decode_batched, split_kv_b
from kestrel.ops.mla.naive import WriteNorms
from kestrel.ops.mla.sdpa_prefill import mla_prefill_sdpa
from kestrel.utils.device import to_device_async
from kestrel.utils.dist import parallel_state

# Prefill chunks of at least this many tokens score the indexer keys with the prefill kernel (blocks of 64 query
# rows share each key tile); shorter ones with the per-row decode kernel, which packs the heads into its dot.
PREFILL_SCORES_MIN_ROWS = 16


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        ps = parallel_state()
        if config.num_attention_heads % ps.tp_size:
            raise ValueError(f"MLA heads {config.num_attention_heads} not divisible by tp_size={ps.tp_size}")
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads // ps.tp_size
        self.nope_dim, self.rope_dim, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.qk_head_dim**-0.5
        D, Hf = config.hidden_size, config.num_attention_heads

        if config.q_lora_rank:
            self.q_a_proj = Linear(D, config.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = ColumnLinear(config.q_lora_rank, Hf * config.qk_head_dim, dtype=dtype)
        else:
            self.q_proj = ColumnLinear(D, Hf * config.qk_head_dim, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(D, config.kv_cache_dim, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = ColumnLinear(config.kv_lora_rank, Hf * (self.nope_dim + self.v_dim), dtype=dtype)
        if config.mla_output_gate:
            self.g_proj = ColumnLinear(D, Hf * self.v_dim, dtype=dtype)
        self.o_proj = RowLinear(Hf * self.v_dim, D, dtype=dtype)
        self.indexer = Indexer(config, dtype) if config.use_dsa else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, D]
        ctx = get_forward_context()
        T, H = x.shape[0], self.num_heads
        # Every projection of x in one launch at decode (`apply_many`): q (or its latent), the latent row, the
        # output gate, the indexer's. The indexer learns only from its own KL loss (model-spec 2.3): its inputs
        # are cut from the graph.
        gate = [(x, self.g_proj)] if hasattr(self, "g_proj") else []
        idx_x = self.indexer.from_x(x.detach()) if self.indexer is not None else []
        first = self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj
        q, kv_a, *rest = apply_many([(x, first), (x, self.kv_a_proj_with_mqa), *gate, *idx_x])
        g = rest.pop(0) if gate else None  # [T, H * Dv]
        if hasattr(self, "q_a_proj"):
            c_q = self.q_a_layernorm(q)  # [T, Rq]
            idx_q = self.indexer.from_q_latent(c_q.detach()) if self.indexer is not None else []
            q, *rest_q = apply_many([(c_q, self.q_b_proj), *idx_q])
            rest = rest_q + rest  # the indexer's queries, key, weights
        q_nope, q_pe = q.view(T, H, -1).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )  # [T, H, Dn], [T, H, Pr]

        # a latent row is [c_kv RMS-normed | k_pe]
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        decode = ctx.cache is not None and ctx.decode  # reads the rows just written from the cache
        # [T, DI], [T, HI, DI], [T, HI]; at decode the keys before their norm and the head weights as projected
        # (the cache write norms the keys and c_kv, the scores kernel scales the weights)
        idx_k_new, idx_q, idx_w = (
            self.indexer.finish(*rest, decode=decode) if self.indexer is not None else (None, None, None)
        )
        if decode:
            kv_norm = (self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)
            index_norm = self.indexer.key_norm() if self.indexer is not None else None
            ctx.cache.write_kv(self.layer_id, (c_kv, k_pe), idx_k_new, WriteNorms(kv_norm, index_norm))
        else:
            c_kv = self.kv_a_layernorm(c_kv)  # [T, R]
            if ctx.cache is not None:
                ctx.cache.write_kv(self.layer_id, (c_kv, k_pe), idx_k_new)

        w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, H, self.nope_dim, self.v_dim)  # [H, Dn, R], [H, Dv, R]
        # (decode's attention reads the keys from the cache: their unnormed copy goes no further)
        idx = (idx_q, idx_w, None if decode else idx_k_new) if self.indexer is not None else None
        kv_new = None if decode else torch.cat([c_kv, k_pe], dim=-1)  # [T, R + Pr]
        if decode:
            out = self._attend_decode(ctx, q_nope, q_pe, w_uk, w_uv, idx)
        elif ctx.cache is None and ctx.row_len is not None:
            out = self._attend_rows(ctx, q.view(T, H, -1), kv_new, idx)  # q whole: no split to cat again
        else:
            out = self._attend_per_sequence(ctx, q_nope, q_pe, kv_new, w_uk, w_uv, idx)

        out = out.reshape(T, H * self.v_dim)
        if g is None:
            return self.o_proj(out)
        if fused_gemv_applies("gate", out, self.o_proj.weight):
            # (decode) the gate inside the o projection's GEMV
            return linear_gated(out, g, self.o_proj.weight)
        return self.o_proj(sigmoid_gate(out, g))  # [T, H * Dv]

    def _select(self, ctx, i: int, pick) -> torch.Tensor:
        """DSA selection of sequence i (or of the whole decode batch, i = -1): replayed, or computed by
        `pick(k)` (scores, then their top-k); captured when the context asks for it."""
        if ctx.selection_replay is not None:
            chosen = ctx.selection_replay[self.layer_id]
            return torch.cat(chosen) if i < 0 else chosen[i]  # [t, topk], chosen in an earlier pass
        if self.indexer.topk is None:  # dense attention requested (evaluation contrast)
            return None
        indices = pick(self.indexer.topk)  # [t, topk]
        if ctx.selection_capture is not None:
            parts = list(indices.split(1)) if i < 0 else [indices]
            ctx.selection_capture.setdefault(self.layer_id, []).extend(parts)
        return indices

    def _attend_per_sequence(self, ctx, q_nope, q_pe, kv_new, w_uk, w_uv, idx) -> torch.Tensor:
        """Prefill, one sequence at a time over its whole cached history. On the fast path (a paged cache and
        Triton) a DSA layer scores, selects and attends straight from the pools, with no gathered copy of the
        history, and neighbouring fresh dense sequences of one length attend in one call; otherwise the
        reference ops run on the gathered history."""
        paged = getattr(ctx.cache, "page_table", None) is not None and triton_attention(q_nope.device)
        runs = self._fresh_dense_runs(ctx, idx) if paged else {}
        outs = []
        attended = 0  # the sequences before this one are attended (a run takes several at once)
        for i in range(ctx.num_seqs):
            if i < attended:
                continue
            if i in runs:  # sequences of one length from position 0, dense: one call for them all
                count, length = runs[i]
                rows = slice(ctx.seq_slice(i).start, ctx.seq_slice(i + count - 1).stop)
                kv = ctx.cache.read_kv_run(self.layer_id, i, count, length)  # [count, length, R + Pr]
                # [count, length, H, *] each
                q_n, q_p = (q[rows].unflatten(0, (count, length)) for q in (q_nope, q_pe))
                outs.append(mla_prefill_sdpa(q_n, q_p, kv, w_uk, w_uv, self.scale).flatten(0, 1))
                attended = i + count
                continue
            sl = ctx.seq_slice(i)
            q_pos = ctx.positions[sl]
            selects = idx is not None and self._selects(ctx, i)
            if paged and selects:
                scores = partial(self._paged_prefill_scores, ctx, i, idx[0][sl], idx[1][sl], q_pos)
                indices = self._select(ctx, i, partial(_pick, scores, q_pos))
                if indices is not None:
                    outs.append(
                        self._attend_sparse_paged(ctx, i, q_nope[sl], q_pe[sl], q_pos, w_uk, w_uv, indices)
                    )
                    continue
            if ctx.cache is not None:
                # [L, R + Pr], and [L, DI] where the selection is scored from them (None otherwise)
                kv, idx_k = ctx.cache.read_kv(self.layer_id, i, index=selects and not paged)
            else:
                kv, idx_k = kv_new[sl], (idx[2][sl] if idx is not None else None)
            indices = None
            if selects and not paged:
                scores = partial(indexer_scores, idx[0][sl], idx_k, idx[1][sl], self.indexer.scale)
                indices = self._select(ctx, i, partial(_pick, scores, q_pos))
            # dense, and the chunk's tokens are the last of the cached rows: fused attention on the fast path
            if indices is None and triton_attention(kv.device) and ctx.cached_len(i) == kv.shape[0]:
                outs.append(mla_prefill_sdpa(q_nope[sl], q_pe[sl], kv, w_uk, w_uv, self.scale))
                continue
            outs.append(
                mla_attention_absorbed(q_nope[sl], q_pe[sl], kv, w_uk, w_uv, q_pos, self.scale, indices)
            )
        return torch.cat(outs)  # [T, H, Dv]

    def _fresh_dense_runs(self, ctx, idx) -> dict[int, tuple[int, int]]:
        """Runs of 2 or more neighbouring sequences that attend the same way in one call: each prefilled from
        position 0 (no cached prefix), densely (no DSA selection), all of one length. {first: (count, length)}.
        One call a run instead of a handful of launches a sequence (mini's 8 x 1024 prefill step: 48 calls)."""

        def length(i: int) -> int | None:
            """What a fresh dense sequence shares with its run; None for the others."""
            fresh_dense = ctx.prefix_lens[i] == 0 and (idx is None or not self._selects(ctx, i))
            return ctx.new_lens[i] if fresh_dense else None

        runs: dict[int, tuple[int, int]] = {}
        for shared, group in itertools.groupby(range(ctx.num_seqs), key=length):
            members = list(group)
            if shared is not None and len(members) > 1:
                runs[members[0]] = (len(members), shared)
        return runs

    def _selects(self, ctx, i: int) -> bool:
        """Whether sequence i's prefill runs the indexer and its top-k. Not where the sequence has at most top-k
        positions, so that every query selects its whole causal past (dense attention, the same result without
        the [t, L] scores; a NaN score, which the top-k would leave out, is not looked for), unless the selection
        is captured or replayed (RL records it for training)."""
        topk = self.indexer.topk
        short = topk is not None and ctx.cached_len(i) <= topk
        return not short or ctx.selection_capture is not None or ctx.selection_replay is not None

    def _paged_prefill_scores(self, ctx, i, q_idx, w_idx, q_pos) -> torch.Tensor:
        """Indexer scores of sequence i's prefill tokens over its paged index keys, every token a row with its
        causal length: [t, pages * page_size] fp32 (the pages that hold the sequence), for the Triton top-k,
        which reads each row's first q_pos + 1 only (past them: NaN, or unwritten). Blocks of rows share each
        key tile (the prefill kernel), instead of a key read per token."""
        from kestrel.ops.dsa.triton_scores import indexer_scores_paged_triton, indexer_scores_prefill_triton

        _, idx_pool, table, _, ps = ctx.cache.paged(self.layer_id)
        t = q_idx.shape[0]
        if t < PREFILL_SCORES_MIN_ROWS:  # a few rows: the per-row kernel packs the heads into its dot instead
            kernel, pages = indexer_scores_paged_triton, _own_pages(ctx, i, table, ps, t)
        else:  # the top-k reads each row's causal part only: the tiles past it are not filled with NaN
            kernel = partial(indexer_scores_prefill_triton, fill_past=False)
            pages = _own_pages(ctx, i, table, ps, 1)[0]
        return kernel(
            q_idx,
            idx_pool,
            pages,
            q_pos + 1,
            w_idx,
            self.indexer.scale,
            page_size=ps,
            key_scale=ctx.cache.index_scales(self.layer_id),
        )

    def _attend_sparse_paged(self, ctx, i, q_nope, q_pe, q_pos, w_uk, w_uv, indices) -> torch.Tensor:
        """Sparse prefill of sequence i. Where its causal pairs cost less than its selected pairs
        (KESTREL_SPARSE_PREFILL=auto, `use_expanded`): the history gathered and expanded per head, blocks of
        queries sharing each key tile, the selection as a mask. Elsewhere: the paged decode kernel, every prefill
        token a row of its own reading only its selected rows of the pool (no [t, L] scores, no gathered copy)."""
        from kestrel.ops.mla.triton_decode import mla_decode_paged
        from kestrel.ops.mla.triton_prefill_expanded import sparse_mla_prefill_expanded, use_expanded

        kv_pool, _, table, _, ps = ctx.cache.paged(self.layer_id)
        t, length = q_nope.shape[0], ctx.cached_len(i)  # the chunk's t tokens are the last of `length`
        mode = env_field("sparse_prefill")
        if mode == "expanded" or (mode == "auto" and use_expanded(length - t, t, indices.shape[1])):
            kv = kv_pool[ctx.cache.read_rows(i)]  # [length, R + P]: the latent rows alone
            distinct = ctx.selection_replay is None  # the top-k's rows never repeat an entry; a replay's may
            return sparse_mla_prefill_expanded(
                q_nope, q_pe, kv, w_uk, w_uv, self.scale, indices, distinct=distinct
            )
        rows = _own_pages(ctx, i, table, ps, t)
        # The top-k lists its selection before the -1s, so a row near the start of the sequence may stop early;
        # a replayed selection comes from elsewhere, with no such promise: every slot is read.
        first = ctx.selection_replay is None
        return mla_decode_paged(
            q_nope, q_pe, kv_pool, rows, ps, q_pos + 1, w_uk, w_uv, self.scale, indices, valid_first=first
        )

    def _attend_decode(self, ctx, q_nope, q_pe, w_uk, w_uv, idx) -> torch.Tensor:
        """Decode: one query per sequence, every sequence at once, no host syncs (CUDA-graph safe)."""
        if hasattr(ctx.cache, "paged") and triton_attention(q_nope.device):
            return self._attend_decode_paged(ctx, q_nope, q_pe, w_uk, w_uv, idx)
        return self._attend_decode_gathered(ctx, q_nope, q_pe, w_uk, w_uv, idx)

    def _attend_decode_paged(self, ctx, q_nope, q_pe, w_uk, w_uv, idx) -> torch.Tensor:
        """Fast path: Triton kernels read the paged pools through the page table (indexer scores, exact
        top-k, sparse MLA over the selection). With no more context than top-k tokens, attention is dense.
        With KESTREL_DSA_TOPK_ROWS=on the CUDA top-k's launch may also make the selection's pool rows
        (`kestrel.ops.dsa.topk_with_rows`), which the sparse MLA then reads instead of translating the positions
        itself; a replayed selection (no top-k runs) and a pick that makes none are translated as before."""
        from kestrel.ops.dsa.triton_scores import indexer_scores_paged_triton
        from kestrel.ops.mla.triton_decode import mla_decode_paged

        kv_pool, idx_pool, table, lens, ps = ctx.cache.paged(self.layer_id)
        indices = rows = None
        sparse = idx is not None and self.indexer.topk is not None and self.indexer.topk < table.shape[1] * ps
        if idx is not None and (
            sparse or ctx.selection_replay is not None or ctx.selection_capture is not None
        ):
            scores = partial(
                indexer_scores_paged_triton,
                idx[0],
                idx_pool,
                table,
                lens,
                idx[1],
                self.indexer.scale,
                page_size=ps,
                key_scale=ctx.cache.index_scales(self.layer_id),
                weights_scale=self.indexer.weight_scale,  # idx[1] as projected
                fill_past=False,  # the top-k reads each row's first lens[b] scores only
            )
            kernel = fast_topk(q_nope.device)  # takes the lengths (the query's position + 1) as they are
            with_rows = topk_with_rows(kernel)
            if with_rows is None:
                indices = self._select(ctx, -1, lambda k: kernel(scores(), lens, k))
            else:
                made = []  # the pool rows of the top-k's launch: none where the pick is not a short variant

                def pick(k: int) -> torch.Tensor:
                    positions, pool_rows = with_rows(scores(), lens, k, table, ps)
                    made.append(pool_rows)
                    return positions

                indices = self._select(ctx, -1, pick)  # captured as ever: the positions
                rows = made[0] if made else None  # none where the selection was replayed (pick not called)
        return mla_decode_paged(
            q_nope, q_pe, kv_pool, table, ps, lens, w_uk, w_uv, self.scale, indices, rows=rows
        )

    def _attend_decode_gathered(self, ctx, q_nope, q_pe, w_uk, w_uv, idx) -> torch.Tensor:
        """Reference-grade batched path: every sequence's padded history gathered, then plain torch ops."""
        kv, idx_k, lens = ctx.cache.read_kv_batched(self.layer_id)  # [N, Lmax, R + Pr], [N, Lmax, DI], [N]
        indices = None
        if idx is not None:
            w = self.indexer.head_weights(idx[1])  # idx[1] as projected at decode
            scores = partial(indexer_scores_batched, idx[0], idx_k, w, self.indexer.scale)
            indices = self._select(ctx, -1, lambda k: topk_select(scores(), lens - 1, k))
        return mla_decode_batched(q_nope, q_pe, kv, lens, w_uk, w_uv, self.scale, indices)  # [N, H, Dv]

    def _attend_rows(self, ctx, q, kv_new, idx) -> torch.Tensor:
        """Training: B rows of R tokens, documents never crossing rows (ctx.row_len). Each token sees the earlier
        tokens of its own document (and, in sparse mode, only the DSA selection among them). With
        ctx.extras["indexer_kl"] a list, the indexer's KL loss against this attention is appended to it.
        q [T, H, Dn + Pr] as the projection lays it out (the attention reads it whole)."""
        T, H = q.shape[:2]
        R = ctx.row_len
        B = T // R
        allowed = _document_causal(ctx, B, R)  # [B, R, R], shared by the step's MLA layers
        if idx is not None:
            q_i, w_i, k_i = (t.view(B, R, *t.shape[1:]) for t in idx)
            if not ctx.extras.get("dsa_dense", False) and self.indexer.topk is not None:
                allowed = allowed.clone()  # narrowed in place to this layer's selection
                self._select_rows(ctx, q_i, w_i, k_i, allowed)
            if ctx.extras.get("indexer_kl") is not None:
                q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
                ctx.extras["indexer_kl"].append(
                    self._indexer_kl(q_nope, q_pe, kv_new, (q_i, w_i, k_i), allowed, B, R)
                )
        out = mla_attention_rows(
            q.view(B, R, H, -1),
            kv_new.view(B, R, -1),
            self.kv_b_proj.weight,
            allowed,
            self.scale,
            self.v_dim,
            flex=_use_flex(q.device, R),
        )  # [B, R, H, Dv]
        return out.reshape(T, H, self.v_dim)

    @torch.no_grad()  # the selection is not differentiable: no graph for the score matrix
    def _select_rows(self, ctx, q_i, w_i, k_i, allowed: torch.Tensor) -> None:
        """Sparse training: narrow `allowed` [B, R, R] (the document-causal mask) in place to each query's DSA
        top-k. Only queries with more than top-k visible tokens (deep in a long document) can lose any, so only
        their rows are scored, over their own document's keys (NaN elsewhere). Which queries those are, and
        where their documents start, is read off the host's copy of the positions: no device sync in the loop."""
        B, R, k = allowed.shape[0], allowed.shape[1], self.indexer.topk
        flat, first, counts = _rows_to_score(ctx, B, R, k, allowed.device)
        topk, keep, triton = (
            _topk_fn(allowed.device),
            _keep_fn(allowed.device),
            triton_attention(allowed.device),
        )
        start = 0
        for b in range(B):
            picks, starts = flat[start : start + counts[b]], first[start : start + counts[b]]  # [M] each
            start += counts[b]
            if counts[b] == 0:
                continue
            if triton:
                scores = self.indexer.row_scores_triton(q_i[b], w_i[b], k_i[b], picks, starts)  # [M, R]
            else:
                scores = self.indexer.row_scores(q_i[b : b + 1], w_i[b : b + 1], k_i[b : b + 1], picks)[0]
                cols = torch.arange(R, device=scores.device)
                scores.masked_fill_((cols < starts[:, None]) | (cols > picks[:, None]), float("nan"))
            keep(allowed[b], picks, topk(scores, picks, k))

    def _indexer_kl(self, q_nope, q_pe, kv_new, idx_rows, allowed, B, R, samples: int = 64) -> torch.Tensor:
        """KL of the indexer against the attention of a strided sample of queries per row (targets detached);
        the indexer's scores are computed, with their graph, for those queries only."""
        H = q_nope.shape[1]
        picks = torch.arange(
            R - 1, -1, -max(R // samples, 1), device=q_nope.device
        )  # [Q], the last token first
        with torch.no_grad():
            c_kv, k_pe = kv_new.view(B, R, -1).float().split([self.kv_lora_rank, self.rope_dim], dim=-1)
            w_uk, _ = split_kv_b(self.kv_b_proj.weight.float(), H, self.nope_dim, self.v_dim)
            q_lat = torch.einsum(
                "bqhd,hdr->bqhr", q_nope.view(B, R, H, -1)[:, picks].float(), w_uk
            )  # [B, Q, H, Rk]
            att = torch.einsum("bqhr,bsr->bhqs", q_lat, c_kv)
            att = att + torch.einsum("bqhp,bsp->bhqs", q_pe.view(B, R, H, -1)[:, picks].float(), k_pe)
            mask = allowed[:, picks]  # [B, Q, R]
            probs = torch.softmax((att * self.scale).masked_fill(~mask[:, None], float("-inf")), dim=-1)
        scores = self.indexer.picked_scores(*idx_rows, picks)  # [B, Q, R]
        Q = picks.numel()
        return indexer_kl(
            probs.permute(0, 2, 1, 3).reshape(B * Q, H, R), scores.reshape(B * Q, R), mask.reshape(B * Q, R)
        ) / (B * Q)


def dsa_topks(model: torch.nn.Module) -> list[int | None]:
    """Each DSA layer's top-k as it stands (None: dense attention, `set_dense_attention`)."""
    return [m.indexer.topk for m in model.modules() if isinstance(m, MLAttention) and m.indexer is not None]


def set_dense_attention(model: torch.nn.Module, dense: bool) -> None:
    """Switch every DSA layer of `model` to dense attention over all visible tokens, or back to the
    indexer's top-k selection (the config's index_topk), in place: the sparse-vs-dense contrast of evals."""
    for module in model.modules():
        if isinstance(module, MLAttention) and module.indexer is not None:
            module.indexer.topk = None if dense else module.indexer.config_topk


def _own_pages(ctx, i: int, table: torch.Tensor, page_size: int, rows: int) -> torch.Tensor:
    """Sequence i's page table, as many pages as hold it (not the batch's widest), shared by `rows` query rows
    (a stride-0 expand): the layout in which prefill runs the decode kernels, every token a row. [rows, pages]"""
    pages = -(-ctx.cached_len(i) // page_size)
    return table[i : i + 1, :pages].expand(rows, -1)


def triton_attention(device: torch.device) -> bool:
    """MLA/DSA over the paged cache runs the Triton kernels on `device` (KESTREL_ATTN_BACKEND: auto, on CUDA),
    else the plain-torch references."""
    choice = env_field("attn_backend")  # asked several times per layer and step: one variable, not all
    if choice == "torch":
        return False
    if choice == "triton":
        return True  # on CPU this needs TRITON_INTERPRET=1 (the tests use it)
    return device.type == "cuda"


def _use_flex(device: torch.device, row_len: int) -> bool:
    """KESTREL_TRAIN_ATTENTION=flex (the default): training's row attention through FlexAttention, on CUDA for
    rows of a multiple of its 128-token blocks; sdpa: the dense masked kernel."""
    return device.type == "cuda" and row_len % 128 == 0 and env_field("train_attention") == "flex"


def _topk_fn(device: torch.device):
    """The exact DSA top-k for scores on `device`, with `topk_select`'s signature (scores, q_pos, k): where the
    attention backend is Triton, the kernel `fast_topk` picks (KESTREL_DSA_TOPK); else the reference. The
    kernels select the same positions."""
    if not triton_attention(device):
        return topk_select
    kernel = fast_topk(device)
    return lambda scores, q_pos, k: kernel(scores, q_pos + 1, k)


def _keep_fn(device: torch.device):
    """`keep_selected_` for masks on `device`: the Triton kernel where the attention backend is Triton."""
    if not triton_attention(device):
        return keep_selected_
    from kestrel.ops.dsa.triton_select import keep_selected_triton

    return keep_selected_triton


def _pick(scores_fn, q_pos: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k of `scores_fn()` [t, L] for queries at q_pos [t] (a `_select` pick)."""
    return _topk_fn(q_pos.device)(scores_fn(), q_pos, k)


def _rows_to_score(
    ctx, B: int, R: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The queries sparse training must select for, per row: those whose position in the document is >= k
    (more than k visible tokens). Read off the host's positions, so no device sync; built once per forward
    (ctx.extras) and shared by its MLA layers. Returns their positions within their rows, row after row, and
    where their documents start within those rows, on `device` ([sum(counts)] each), and their count in each
    row ([B], host)."""
    key = ("dsa_rows_to_score", k)
    cached = ctx.extras.get(key)
    if cached is None:
        positions = ctx.host_positions().view(B, R)  # [B, R] (CPU): each token's position in its document
        rows, cols = (positions >= k).nonzero().unbind(1)
        both = to_device_async(torch.stack([cols, cols - positions[rows, cols]]), device)  # one copy, no wait
        cached = ctx.extras[key] = (both[0], both[1], torch.bincount(rows, minlength=B).tolist())
    return cached


def _document_causal(ctx, B: int, R: int) -> torch.Tensor:
    """[B, R, R] bool: key s is visible to query t when both are in the same document and s <= t. Built once
    per forward (ctx.extras) and shared by its MLA layers: callers that narrow it clone it first."""
    cached = ctx.extras.get("document_causal")
    if cached is None:
        cached = ctx.extras["document_causal"] = _build_document_causal(ctx, B, R)
    return cached


def _build_document_causal(ctx, B: int, R: int) -> torch.Tensor:
    # [B, R] document id of every token: the number of documents that start at or before it, minus one (read
    # off the device's cu_seqlens: building it from the host's lengths would wait for the stream)
    starts = ctx.cu_seqlens[1:-1]
    doc = torch.searchsorted(starts, torch.arange(B * R, device=starts.device), right=True).view(B, R)
    causal = torch.ones(R, R, dtype=torch.bool, device=doc.device).tril()
    return (doc[:, :, None] == doc[:, None, :]) & causal
