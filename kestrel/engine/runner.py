"""Runs the model on a scheduled batch: builds the ForwardContext (positions, cu_seqlens, page rows, state slots)
and returns the logits of the requests that sample this step.

Prefill chunks run packed (varlen, no padding) through the per-sequence path. Decode runs every request at
once through the batched path, which has no host syncs; on CUDA it is captured in graphs per batch-size
bucket and replayed (`use_cuda_graph=False`, or `--disable-cuda-graph`, runs it eagerly). With
`short_graph_len` (`--cuda-graph-short-len`), on an engine whose context limit is long each batch size has a
second graph whose page table is only that many tokens wide, which steps whose every context fits take
(`graph_widths`). Staging a decode step does not wait for the device either (its host values go up through
pinned memory), and its input tokens may be given as a device tensor: the engine launches a decode step before
it has read back the tokens of the step in front of it (the overlap schedule).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time

import torch
from tqdm import tqdm

from kestrel.cache.kv_pool import KVPool
from kestrel.cache.state_pool import StatePool
from kestrel.cache.view import KDASaves, PagedCacheView
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Batch, PrefillChunk
from kestrel.layers.context import ForwardContext, forward_context
from kestrel.layers.mla import dsa_topks
from kestrel.models.kimi import KimiForCausalLM
from kestrel.ops.sampling import argmax
from kestrel.utils.device import to_device_async

log = logging.getLogger("kestrel.engine")

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_widths(max_pages: int, page_size: int, short_len: int, dsa_topk: int | None) -> tuple[int, ...]:
    """The page-table widths (in pages, ascending) of the decode graphs captured for each batch size: the
    engine's whole limit, `max_pages`, and a short width of `short_len` tokens where the limit is at least twice
    that (below it one more capture a batch size buys little). Not where a DSA layer's top-k would take every
    position of the short width (`dsa_topk` >= short_len): MLA decode picks its dense or sparse form by the
    table's width, and the short graph would run the other one. short_len 0: one width.

    Why: a graph's kernels are sized by its width (the indexer's scores buffer, the DSA top-k's block a row), so
    at a short context on a 131072-token engine (`kestrel serve`'s default on mini) the step runs wide kernels
    over empty columns. On the H200 (session 47) batch 1 at 4K took 1.47 ms against 1.42 on an engine sized to
    the context, batch 256 6.51 against 6.36-6.41; the DSA top-k of a 4K row in a 131072-wide buffer 17.2 us
    against 12.4 in a tight one. With graphs 8192 wide beside (session 52, three alternating pairs), batch 1 / 64 /
    256 at 4K: 1.410 / 3.896 / 6.336 ms against 1.470 / 3.945 / 6.423, for 15 more graphs and 0.29 GiB; 8192 is
    EngineConfig's default since session 53, when their CUDA test's tokens matched (8192: the top-k's 256- and
    512-thread variants take rows up to 8704 wide)."""
    short = -(-short_len // page_size)
    if short_len <= 0 or 2 * short > max_pages or (dsa_topk is not None and dsa_topk >= short * page_size):
        return (max_pages,)
    return (short, max_pages)


class ModelRunner:
    def __init__(
        self,
        model: KimiForCausalLM,
        kv_pool: KVPool,
        state_pool: StatePool,
        max_context: int,
        use_cuda_graph: bool = True,
        graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES,
        max_batch: int = 256,
        checkpoint_pool: StatePool | None = None,
        short_graph_len: int = 0,
    ):
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.checkpoint_pool = checkpoint_pool  # the prefix cache's: mid-chunk KDA checkpoints go there
        self.slot_pages: torch.Tensor | None = None  # decode graphs: each state slot's pages (see _stage)
        self.static_tokens: torch.Tensor | None = None  # decode graphs: ids, positions, slots [3, size]
        self._sent: dict[int, tuple[list[int], int]] = {}  # slot -> (its request's page list, pages sent)
        self.device = model.lm_head.weight.device
        self.max_pages = kv_pool.pages_for(max_context)
        self.short_graph_len = short_graph_len
        # the decode graphs' page-table widths in pages, ascending (capture_graphs sets them: graph_widths)
        self.widths: tuple[int, ...] = (self.max_pages,)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (width in pages, batch size) -> graph
        self.argmax: torch.Tensor | None = None  # the last forward's, from its decode graph (see forward)
        # the last forward's prefill chunks that want their prompt's logprobs, each with its positions' logits
        self.prompt_logits: list[tuple[PrefillChunk, torch.Tensor]] = []
        self.graph_sizes = tuple(sorted(s for s in graph_batch_sizes if s <= max_batch))
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda" and bool(self.graph_sizes)
        self.graph_bytes = 0  # torch's reserved memory the last capture added (capture_graphs)

    @torch.no_grad()
    def forward(self, batch: Batch, decode_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(batch.sampled), V] in the model's dtype, rows in `batch.sampled` order. `decode_ids`
        [len(batch.decode)], on the device: the decode requests' input tokens, where the host's lists do not have
        them yet.
        `self.argmax` is then their rows' argmax where a decode graph computed it (a decode-only step
        replayed), else None; both are the graph's buffers, valid until the next forward. `self.prompt_logits`:
        the logits [end - start, V] of every position of each chunk whose request asks for prompt logprobs
        (`PrefillChunk.prompt_logprobs`)."""
        rows = []
        self.argmax, self.prompt_logits = None, []
        if batch.decode:
            logits, best = self._decode(batch.decode, decode_ids)
            rows.append(logits)
            self.argmax = best if not batch.prefill else None
        sampling = [c for c in batch.prefill if c.samples]
        if batch.prefill:
            logits = self._prefill(batch.prefill)
            if sampling:
                rows.append(logits)
        if not rows:
            return torch.empty(0)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    # -- prefill ----------------------------------------------------------------------------------------
    def _prefill(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        dev, kv = self.device, self.kv_pool
        ids = [t for c in chunks for t in c.request.all_ids[c.start : c.end]]
        new_lens = [c.end - c.start for c in chunks]
        write_rows = torch.cat([kv.token_rows(c.request.pages, c.start, c.end) for c in chunks])
        width = max(len(c.request.pages) for c in chunks)
        view = PagedCacheView(
            kv,
            self.state_pool,
            slots=torch.tensor([c.request.slot for c in chunks], device=dev),
            write_rows=write_rows.to(dev),
            page_table=torch.tensor(
                [c.request.pages + [0] * (width - len(c.request.pages)) for c in chunks], device=dev
            ),
            lens=torch.tensor([c.end for c in chunks], device=dev),
            ends=[c.end for c in chunks],
        )
        ctx = ForwardContext.build(new_lens, [c.start for c in chunks], view, dev)
        ctx.decode = False  # prefill chunks read per sequence, even when each is one token long
        saves = [(i, p - c.start, slot) for i, c in enumerate(chunks) for p, slot in c.saves]
        if saves:
            view.saves = KDASaves(self.checkpoint_pool, [0, *itertools.accumulate(new_lens)], saves, dev)
        ends = torch.tensor(new_lens).cumsum(0) - 1
        keep = torch.tensor([c.samples for c in chunks])
        if not any(c.prompt_logprobs for c in chunks):
            with forward_context(ctx):
                return self.model(torch.tensor(ids, device=dev), logits_indices=ends[keep].to(dev))
        # every position of the chunks that want prompt logprobs, the last of the others that sample
        index, sampled, spans = [], [], []
        for c, end, n in zip(chunks, ends.tolist(), new_lens):
            if c.prompt_logprobs:
                spans.append((c, len(index), n))
                index.extend(range(end - n + 1, end + 1))
            elif c.samples:
                index.append(end)
            if c.samples:
                sampled.append(len(index) - 1)
        with forward_context(ctx):
            logits = self.model(torch.tensor(ids, device=dev), logits_indices=torch.tensor(index, device=dev))
        self.prompt_logits = [(c, logits[a : a + n]) for c, a, n in spans]
        return logits[torch.tensor(sampled, dtype=torch.long, device=dev)]

    # -- decode -----------------------------------------------------------------------------------------
    def _decode_inputs(self, reqs: list[Request], width: int, size: int):
        """ids, positions, slots, page table [size, width], lens and write rows; rows past len(reqs) are
        padding: dummy slot 0, dummy page 0, length 1."""
        ps, pad = self.kv_pool.page_size, size - len(reqs)
        ids, pos, slots = _token_inputs(reqs, size)
        table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in reqs] + [[0] * width] * pad)
        lens = pos + 1
        rows = _write_rows(table, pos, ps)
        return ids, pos, slots, table, lens, rows

    def _decode(
        self, reqs: list[Request], ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode requests' logits [n, V] and, from a graph, their argmax [n] (eagerly: None)."""
        n = len(reqs)
        if self.use_cuda_graph and n <= self.graph_sizes[-1]:
            logits, best = self._replay(reqs, ids)
            return logits[:n], best[:n]
        width = max(len(r.pages) for r in reqs)
        tensors = [to_device_async(t, self.device) for t in self._decode_inputs(reqs, width, n)]
        if ids is not None:
            tensors[0] = ids
        return self._decode_forward(*tensors), None

    def _decode_forward(self, ids, pos, slots, table, lens, rows) -> torch.Tensor:
        n = ids.shape[0]
        view = PagedCacheView(self.kv_pool, self.state_pool, slots, rows, page_table=table, lens=lens)
        ctx = ForwardContext(pos, torch.arange(n + 1, device=ids.device), [1] * n, [0] * n, view, decode=True)
        with forward_context(ctx):
            return self.model(ids)

    # -- CUDA graphs ------------------------------------------------------------------------------------
    @torch.no_grad()  # no autograd history on the pools: capture writes KV like any decode step
    def capture_graphs(self) -> None:
        """Capture one decode graph per batch-size bucket and page-table width (`graph_widths`; widest and
        largest first, sharing one memory pool). Each graph ends with the logits' argmax (what greedy rows take;
        `kestrel.ops.sampling.argmax`): inside the graph it costs the host no launch (torch's argmax eagerly took
        ~30-50 us a step at batch 1, session 26)."""
        if not self.use_cuda_graph:
            return
        topk = max((k for k in dsa_topks(self.model) if k is not None), default=None)
        self.widths = graph_widths(self.max_pages, self.kv_pool.page_size, self.short_graph_len, topk)
        # each capture empties torch's cache on entering (torch.cuda.graph): emptied first, the cache's free
        # blocks (a dropped engine's, say) are not counted as released by the capture (graph_bytes went negative,
        # -52 GiB after another test's engine on the H200, session 52)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        self._static_inputs()
        # (width, bs) -> logits, argmax
        self.static_out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        pool, start = None, time.perf_counter()
        keys = [(width, bs) for width in reversed(self.widths) for bs in reversed(self.graph_sizes)]
        # a bar on a terminal (a big model's capture takes a while, short graphs double it), nothing in logs
        for width, bs in tqdm(keys, desc="capturing decode graphs", unit="graph", disable=None, leave=False):
            args = self._graph_inputs(width, bs)
            for _ in range(2):  # warm up (Triton autotuning, lazy init) outside the capture
                self._page_inputs(*args)
                self._decode_forward(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._page_inputs(*args)
                logits = self._decode_forward(*args)
                self.static_out[width, bs] = (logits, argmax(logits))
            pool = graph.pool()
            self.graphs[width, bs] = graph
        torch.cuda.synchronize()
        # what the capture kept in torch's cache (its inputs, the graphs' pool with their outputs): the memory
        # plan has no term for it, so short graphs' second set is seen here (and in bench decode's record)
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info(
            "decode graphs: %d captured in %.1f s holding %.2f GiB (batch sizes %d-%d; page tables %s tokens wide)",
            len(keys),
            time.perf_counter() - start,
            self.graph_bytes / 2**30,
            self.graph_sizes[0],
            self.graph_sizes[-1],
            " and ".join(str(w * self.kv_pool.page_size) for w in self.widths),
        )

    def _static_inputs(self) -> None:
        """The graphs' inputs, padded to the largest batch bucket, on the runner's device: ids, positions and slots
        (`static_tokens` [3, size], one copy up a step in _stage), each width's page table (`tables`), lengths
        and write rows (`static`: the whole width's table among them), and `slot_pages`."""
        size, dev = self.graph_sizes[-1], self.device
        ids, pos, slots, table, lens, rows = self._decode_inputs([], self.max_pages, size)
        self.static_tokens = torch.stack([ids, pos, slots]).to(dev)
        self.tables = {w: table[:, :w].contiguous().to(dev) for w in self.widths}
        self.static = [*self.static_tokens, self.tables[self.max_pages], lens.to(dev), rows.to(dev)]
        if self.slot_pages is None:  # kept by a recapture: its rows are the pages already sent (`_sent`)
            self.slot_pages = torch.zeros(
                self.state_pool.num_slots + 1, self.max_pages, dtype=table.dtype, device=dev
            )

    def _graph_inputs(self, width: int, bs: int) -> list[torch.Tensor]:
        """The static inputs of the (width, bs) graph: ids, positions, slots, page table, lens, write rows."""
        ids, pos, slots, _, lens, rows = (t[:bs] for t in self.static)
        return [ids, pos, slots, self.tables[width][:bs], lens, rows]

    def graph_key(self, reqs: list[Request]) -> tuple[int, int]:
        """The (width, batch size) of the graph that runs these decode requests: the smallest batch bucket that
        holds them, and the narrowest width that holds every request's pages up to the position it computes."""
        bs = self.graph_sizes[bisect.bisect_left(self.graph_sizes, len(reqs))]
        if len(self.widths) == 1:
            return self.widths[0], bs
        need = max(r.num_computed for r in reqs) // self.kv_pool.page_size + 1
        return self.widths[bisect.bisect_left(self.widths, need)], bs

    @torch.no_grad()
    def recapture_graphs(self) -> None:
        """Drop the decode graphs and capture them again (after a change to what the decode step runs)."""
        if not self.graphs:
            return
        self.graphs.clear()  # capture_graphs refills it (and its static inputs and outputs)
        torch.cuda.synchronize()
        self.capture_graphs()

    def _page_inputs(self, ids, pos, slots, table, lens, rows) -> None:
        """Inside a decode graph, from the staged positions and slots: each row's page table (its slot's row of
        `slot_pages`), its length, and the pool row its token's KV goes to."""
        torch.index_select(self.slot_pages[:, : table.shape[1]], 0, slots, out=table)
        torch.add(pos, 1, out=lens)
        rows.copy_(_write_rows(table, pos, self.kv_pool.page_size))

    def _stage(self, reqs: list[Request], ids: torch.Tensor | None = None) -> None:
        """Load a decode batch into the graphs' static inputs (padded); `ids` [len(reqs)] on the device replaces
        the tokens from the request lists.

        The tokens, positions and slots go up in one copy; the graph itself gathers each row's page table from
        `slot_pages`, a device table with one row per state slot holding its request's pages
        (`_page_inputs`). A step sends only the pages requests gained since their last step (one per request
        every page_size tokens). Building the whole table from the request lists every step cost milliseconds
        of host time (256 rows x 2,049 pages at 128K context: 48 ms on this CPU), and computing it here took
        a handful of eager kernels a step. Entries past a row's pages are stale but valid page ids; no kernel
        reads a page past a row's length. Padding rows take the dummy slot 0, whose row stays page 0."""
        rows: list[int] = []
        cols: list[int] = []
        new_pages: list[int] = []
        for r in reqs:
            # The page list last sent for this slot: a new list (admission, or re-admission after a retraction)
            # is sent whole; the same list only past what was sent (pages are only ever appended to it).
            sent, count = self._sent.get(r.slot, (None, 0))
            start = count if sent is r.pages else 0
            rows += [r.slot] * (len(r.pages) - start)
            cols += range(start, len(r.pages))
            new_pages += r.pages[start:]
            self._sent[r.slot] = (r.pages, len(r.pages))
        if new_pages:
            where = to_device_async(torch.tensor([rows, cols, new_pages]), self.device)
            self.slot_pages[where[0], where[1]] = where[2].to(self.slot_pages.dtype)
        host = torch.stack(_token_inputs(reqs, self.static_tokens.shape[1]))  # [3, size], rows past bs unread
        pinned = host.pin_memory() if self.static_tokens.is_cuda else host  # pinned: no wait for the stream
        self.static_tokens.copy_(pinned, non_blocking=True)
        if ids is not None:
            self.static[0][: len(reqs)].copy_(ids)

    def _replay(
        self, reqs: list[Request], ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = self.graph_key(reqs)
        self._stage(reqs, ids)
        self.graphs[key].replay()
        return self.static_out[key]


def _token_inputs(reqs: list[Request], size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch's ids, positions and state slots [size] (CPU); rows past len(reqs) are padding: token 0 at
    position 0 in the dummy slot 0. A decode step computes position num_computed (the request's last token; a
    step launched ahead computes the one its in-flight step is sampling, which the engine passes as ids)."""
    pad = [0] * (size - len(reqs))
    ids = torch.tensor([r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs] + pad)
    pos = torch.tensor([r.num_computed for r in reqs] + pad)
    return ids, pos, torch.tensor([r.slot for r in reqs] + pad)


def _write_rows(table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """The pool row [N] where each decode token's KV goes: position pos[n] through page-table row table[n]."""
    return table.gather(1, (pos // page_size)[:, None])[:, 0] * page_size + pos % page_size
