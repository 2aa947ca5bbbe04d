"""The training stream: a seeded mixture of task families, rendered as chat documents and packed into rows.

Dimension letters: B rows per batch, T tokens per row, N documents (plus one padding segment per row) in a batch.

- `Mixture.example(seed, index)` is a pure function of (seed, index): the family is picked by a hash of both,
  then the family generates from the same pair. Train uses seeds `[0, HELDOUT_SEED_OFFSET)`, held-out the same
  seeds shifted by `HELDOUT_SEED_OFFSET`; see `kestrel.train.family` for why their prompts never overlap.
- `PackedBatches` packs documents first-fit from a small look-ahead buffer into rows of exactly T tokens; a
  document never crosses rows, the rest of a row is padding with loss mask 0. Documents longer than T are
  skipped (`num_skipped` counts them). Its state (next index, buffered indices) resumes the exact stream at
  the same row length; at a shorter one, restored documents longer than a row are skipped as any other.
- `Prefetch` makes a source's batches a few ahead in a background thread, each with the source's state right
  after it, so the trainer's packing and host-to-device copies overlap the GPU step.
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import queue
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np
import torch

from kestrel.tokenizer import Tokenizer, load_tokenizer
from kestrel.train.chat_format import assistant_text, render
from kestrel.train.family import HELDOUT_SEED_OFFSET, Example, Family, derive_seed
from kestrel.train.retrieval import Retrieval
from kestrel.train.tasks import FAMILIES, make_family
from kestrel.utils.errors import ConfigError

# Per document; a 2K-token retrieval document weighs about 20 arithmetic ones in tokens.
DEFAULT_WEIGHTS = dict(chain_sum=1.0, basic_arithmetic=1.0, gsm_symbolic=1.0, countdown=1.0, retrieval=0.1)
SPLITS = ("train", "heldout")
# this many documents in a row too long for a row: the packer stops (none of the mixture may fit) with an error
MAX_SKIPPED_IN_A_ROW = 1000


def split_seed(seed: int, split: str) -> int:
    """The family seed for `seed` in a split: held-out lives in its own seed namespace."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
    if not 0 <= seed < HELDOUT_SEED_OFFSET:
        raise ValueError(f"seed must be in [0, {HELDOUT_SEED_OFFSET}), got {seed}")
    return seed + (HELDOUT_SEED_OFFSET if split == "heldout" else 0)


@dataclass(frozen=True)
class MixtureConfig:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    levels: dict[str, str] = field(default_factory=dict)  # family -> level; a family's default otherwise
    retrieval_context_tokens: tuple[int, ...] = (2048,)  # one is picked per retrieval example
    system: str | None = None  # an optional system message in every conversation
    # the share of retrieval problems with a distractor whose code shares the asked code's first digits
    retrieval_shared_prefix: float = 0.0
    # (lo, hi): the number of distractor facts per retrieval problem, over the level's (retrieval.Retrieval)
    retrieval_distractors: tuple[int, int] | None = None
    # a shared-prefix problem gives every distractor a shared prefix, not one (retrieval.Retrieval)
    retrieval_shared_all: bool = False
    # family -> weight of its documents' loss tokens in the weighted mean loss (1.0 where absent); unlike
    # `weights` it costs no compute: it shifts the gradient toward a family without drawing more of it
    loss_weights: dict[str, float] = field(default_factory=dict)


def _check_family_numbers(config: MixtureConfig) -> None:
    """ValueError for a family name that is none (in levels or loss_weights it was ignored) or a weight that is
    not a finite number >= 0: an infinite draw weight made every draw the last family's, NaN dropped the family
    silently, and a negative loss weight trained the family's loss up."""
    for what, table in (
        ("weights", config.weights),
        ("levels", config.levels),
        ("loss_weights", config.loss_weights),
    ):
        unknown = sorted(set(table) - set(FAMILIES))
        if unknown:
            raise ValueError(f"{what}: unknown task family {unknown[0]!r}; choose from {sorted(FAMILIES)}")
    for what, table in (("weights", config.weights), ("loss_weights", config.loss_weights)):
        for name, w in table.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
                raise ValueError(f"{what}[{name!r}] must be a finite number >= 0, got {w!r}")


class Mixture:
    def __init__(self, config: MixtureConfig | None = None, tokenizer: Tokenizer | None = None):
        self.config = config or MixtureConfig()
        _check_family_numbers(self.config)
        weights = {name: w for name, w in self.config.weights.items() if w > 0}
        if not weights:
            raise ValueError("the mixture needs at least one family with a positive weight")
        self.families: dict[str, Family] = {}
        for name in weights:
            extra = (
                {
                    "tokenizer": tokenizer,
                    "shared_prefix": self.config.retrieval_shared_prefix,
                    "distractors": self.config.retrieval_distractors,
                    "shared_all": self.config.retrieval_shared_all,
                }
                if name == "retrieval"
                else {}
            )
            self.families[name] = make_family(name, self.config.levels.get(name), **extra)
        total, acc = sum(weights.values()), 0.0
        self._cumulative = []
        for name, w in weights.items():
            acc += w / total
            self._cumulative.append((acc, name))

    def example(self, seed: int, index: int) -> Example:
        """Example `index` of the stream for a family seed (already shifted for held-out)."""
        u = derive_seed("mixture", seed, index) / 2**64
        name = next((n for acc, n in self._cumulative if u < acc), self._cumulative[-1][1])
        kwargs = {}
        if name == "retrieval":
            lengths = self.config.retrieval_context_tokens
            kwargs["context_tokens"] = lengths[derive_seed("length", seed, index) % len(lengths)]
        return self.families[name].generate(seed, index, **kwargs)

    def examples(self, seed: int, split: str = "train", start: int = 0, stop: int | None = None):
        s = split_seed(seed, split)
        index = start
        while stop is None or index < stop:
            yield self.example(s, index)
            index += 1


def heldout_examples(
    family: str, n: int, seed: int = 0, level: str | None = None, tokenizer: Tokenizer | None = None, **kwargs
) -> list[Example]:
    """The first `n` held-out problems of one family; `tokenizer` sizes retrieval prompts, `kwargs` go to
    `generate` (e.g. `context_tokens=8192`)."""
    fam = make_family(family, level, **({"tokenizer": tokenizer} if family == "retrieval" else {}))
    return [fam.generate(split_seed(seed, "heldout"), i, **kwargs) for i in range(n)]


def write_corpus(path: str, n: int, seed: int = 0, config: MixtureConfig | None = None) -> None:
    """Dump `n` conversations of the train stream as plain text (roles as words, no special tokens), one
    document after another separated by a blank line, for tokenizer training."""
    with open(path, "w", encoding="utf-8") as f:
        for text in corpus_texts(n, seed, config):
            f.write(text + "\n\n")


def corpus_texts(n: int, seed: int = 0, config: MixtureConfig | None = None) -> Iterator[str]:
    """Retrieval documents are kept short here (about 256 tokens, counted in characters): the filler
    vocabulary is small, and long documents would only slow tokenizer training down."""
    config = config or MixtureConfig()
    config = replace(config, retrieval_context_tokens=(256,))
    for ex in Mixture(config).examples(seed, "train", 0, n):
        system = f"system\n{config.system}\n" if config.system else ""
        yield f"{system}user\n{ex.prompt}\nassistant\n{assistant_text(ex)}"


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    target_ids: torch.Tensor  # [B, T] int64: the next token of the same document; pad id where loss_mask is 0
    loss_mask: torch.Tensor  # [B, T] bool: the target is an assistant token (end of turn included)
    loss_weight: torch.Tensor  # [B, T] float32: loss_mask times its document's family loss weight
    valid_mask: torch.Tensor  # [B, T] bool: the target is any token of the same document (prompt included)
    position_ids: torch.Tensor  # [B, T] int64: position inside its document (padding counts from 0)
    cu_seqlens: torch.Tensor  # [N+1] int32: segment starts in the flattened B*T tokens; padding is a segment
    max_seqlen: int
    num_documents: int  # real documents, padding segments excluded
    num_loss_tokens: int
    # [B, T] int64: the family index of every token's document (PackedBatches.family_names), -1 on padding
    family_ids: torch.Tensor

    def pin_memory(self) -> Batch:
        """The same batch with the tensors a training step copies to the GPU in pinned memory (for
        non-blocking copies)."""
        names = ("input_ids", "target_ids", "loss_weight", "family_ids")
        return replace(self, **{n: getattr(self, n).pin_memory() for n in names})


@dataclass
class Document:
    """One tokenized conversation of the stream."""

    index: int
    ids: list[int]
    mask: list[int]
    weight: float = 1.0  # its family's loss weight (MixtureConfig.loss_weights)
    family: int = -1  # its family's index in `PackedBatches.family_names` (-1: none given)


class _Renderer:
    """Stream index -> tokenized conversation."""

    def __init__(self, tokenizer: Tokenizer, config: MixtureConfig, family_seed: int):
        self.tokenizer, self.config, self.family_seed = tokenizer, config, family_seed
        self.mixture = Mixture(config, tokenizer)
        self.family_index = {name: i for i, name in enumerate(self.mixture.families)}

    def __call__(self, index: int) -> Document:
        example = self.mixture.example(self.family_seed, index)
        r = render(self.tokenizer, example, self.config.system)
        weight = self.config.loss_weights.get(example.family, 1.0)
        return Document(index, r.ids, r.loss_mask, weight, self.family_index[example.family])


class PackedBatches:
    """An endless iterator of `Batch` over the mixture for one split and seed.

    `tokenizer` is a Tokenizer, or a path / "byte" given to `load_tokenizer`; `num_workers > 0` renders
    documents in that many spawned processes (which need the path form), in the same order."""

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        batch_size: int,
        seq_len: int,
        config: MixtureConfig | None = None,
        seed: int = 0,
        split: str = "train",
        lookahead: int = 64,
        num_workers: int = 0,
    ):
        if num_workers and not isinstance(tokenizer, str):
            raise ValueError("num_workers > 0 needs the tokenizer as a path (each worker loads its own)")
        self._tokenizer_source = tokenizer if isinstance(tokenizer, str) else None
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.config = config or MixtureConfig()
        if self.config.weights.get("retrieval", 0) > 0:  # a prompt of n tokens, plus template and answer
            longest = max(self.config.retrieval_context_tokens)
            need = int(longest * (1 + Retrieval.TOLERANCE)) + 64
            if need > seq_len:
                raise ValueError(
                    f"retrieval prompts of {longest} tokens need rows of at least {need} tokens, not {seq_len}: "
                    "raise the row length or lower the retrieval context lengths"
                )
        self.batch_size, self.seq_len = batch_size, seq_len
        self._render = _Renderer(self.tokenizer, self.config, split_seed(seed, split))
        self.family_names = list(self._render.family_index)  # what a batch's family_ids index
        self.lookahead, self.num_workers = lookahead, num_workers
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            raise ValueError("packing needs a tokenizer with a pad token")
        self.num_skipped = 0
        # documents in a row longer than a row: past MAX_SKIPPED_IN_A_ROW, none may fit at all
        self._too_long = 0
        self._next_index = 0  # the next stream index to enter the buffer
        self._buffer: list[Document] = []
        self._source: Iterator[Document] | None = None
        self._pool = None

    # ---- document source ----------------------------------------------------------------------------------

    def _documents(self, start: int) -> Iterator[Document]:
        if not self.num_workers:
            index = start
            while True:
                yield self._render(index)
                index += 1
        chunk = 32
        if self._pool is None:
            spec = (self._tokenizer_source, self.config, self._render.family_seed)
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(self.num_workers, initializer=_worker_init, initargs=(spec,))
        # Chunks of `chunk` documents in flight, four a worker, oldest first: the oldest is handed on in stream
        # order when done and a new one submitted at once, so a slow chunk delays only the hand-off, never the
        # other workers. (Until session 34 a block of two chunks a worker was submitted only once the block
        # before had finished whole: every worker waited for the block's slowest chunk.)
        window: collections.deque = collections.deque()
        while True:
            while len(window) < 4 * self.num_workers:
                window.append(self._pool.apply_async(_worker_render, ((start, chunk),)))
                start += chunk
            yield from (Document(*d) for d in window.popleft().get())

    def _fill_buffer(self) -> None:
        if self._source is None:
            self._source = self._documents(self._next_index)
        while len(self._buffer) < self.lookahead:
            doc = next(self._source)
            self._next_index = doc.index + 1
            self._admit(doc)

    def _admit(self, doc: Document) -> None:
        """Into the buffer, or skipped (and counted) when longer than a row."""
        if len(doc.ids) > self.seq_len:
            self.num_skipped += 1
            self._too_long += 1
            if self._too_long == MAX_SKIPPED_IN_A_ROW:  # (the stream is endless: it looked for one forever)
                raise ConfigError(
                    f"rows of {self.seq_len} tokens: the last {self._too_long} documents of the mixture were all "
                    "longer, so none may fit; raise the row length (--row-len)"
                )
            return
        self._too_long = 0
        self._buffer.append(doc)

    # ---- packing ------------------------------------------------------------------------------------------

    def _next_row(self) -> list[Document]:
        row, space = [], self.seq_len
        while space:
            self._fill_buffer()
            pick = next((k for k, d in enumerate(self._buffer) if len(d.ids) <= space), None)
            if pick is None:
                break
            doc = self._buffer.pop(pick)
            row.append(doc)
            space -= len(doc.ids)
        return row

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return pack_rows([self._next_row() for _ in range(self.batch_size)], self.seq_len, self.pad_id)

    def state_dict(self) -> dict:
        return {"next_index": self._next_index, "buffer": [d.index for d in self._buffer]}

    def load_state_dict(self, state: dict) -> None:
        # a state saved with longer rows (a run resumed with a shorter --row-len) can hold documents longer than
        # these rows: kept, they were never picked yet held a look-ahead slot each for good (all of them: every row
        # padding, for ever)
        self._buffer, self._too_long = [], 0
        for index in state["buffer"]:
            self._admit(self._render(index))
        self._next_index = state["next_index"]
        self._source = None

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the worker processes, if any; whether they stopped within `timeout` seconds. `Pool.terminate()`
        can hang with tasks in flight (once seen under a loaded CPU), so it runs in a daemon thread, and a
        worker still alive after `timeout` is killed (terminate's first step has stopped the pool replacing them)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return True
        workers = list(getattr(pool, "_pool", ()))  # the processes, for the kill below
        stopper = threading.Thread(target=pool.terminate, name="kestrel-pool-terminate", daemon=True)
        stopper.start()
        stopper.join(timeout)
        if not stopper.is_alive():
            return True
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.join(timeout)
        return not any(worker.is_alive() for worker in workers)


def pack_rows(rows: list[list[Document]], seq_len: int, pad_id: int) -> Batch:
    """Rows of documents -> one Batch. Each row's ids and masks are joined once and the rest is derived with
    array operations: per-document tensor writes cost ~30 ms a batch of 8 x 8704 tokens, on the training
    loop's critical path before `Prefetch`."""
    B, T = len(rows), seq_len
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    target_ids = np.full((B, T), pad_id, dtype=np.int64)
    loss_mask = np.zeros((B, T), dtype=bool)
    loss_weight = np.zeros((B, T), dtype=np.float32)
    valid_mask = np.zeros((B, T), dtype=bool)
    position_ids = np.zeros((B, T), dtype=np.int64)
    family_ids = np.full((B, T), -1, dtype=np.int64)
    seqlens, num_docs = [], 0
    for b, row in enumerate(rows):
        if any(len(doc.mask) != len(doc.ids) for doc in row):
            raise ValueError("a document's loss mask must have one entry per token")
        lengths = np.array([len(doc.ids) for doc in row], dtype=np.int64)
        n = int(lengths.sum())
        if n:
            ids = np.fromiter(chain.from_iterable(doc.ids for doc in row), dtype=np.int64, count=n)
            mask = np.fromiter(chain.from_iterable(doc.mask for doc in row), dtype=bool, count=n)
            starts = np.cumsum(lengths) - lengths
            last = starts + lengths - 1  # nothing is predicted across a document's end
            input_ids[b, :n] = ids
            target_ids[b, : n - 1] = ids[1:]
            target_ids[b, last] = pad_id
            loss_mask[b, : n - 1] = mask[1:]
            loss_mask[b, last] = False
            valid_mask[b, :n] = True
            valid_mask[b, last] = False
            weights = np.repeat(np.array([doc.weight for doc in row], dtype=np.float32), lengths)
            loss_weight[b, :n] = weights * loss_mask[b, :n]
            family_ids[b, :n] = np.repeat(np.array([doc.family for doc in row], dtype=np.int64), lengths)
            position_ids[b, :n] = np.arange(n) - np.repeat(starts, lengths)
        position_ids[b, n:] = np.arange(T - n)  # padding counts from 0
        seqlens += lengths.tolist() + ([T - n] if n < T else [])
        num_docs += len(row)
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int32), 0)
    stats = dict(max_seqlen=max(seqlens), num_documents=num_docs, num_loss_tokens=int(loss_mask.sum()))
    tensors = (input_ids, target_ids, loss_mask, loss_weight, valid_mask, position_ids)
    return Batch(
        *map(torch.from_numpy, tensors), cu_seqlens, **stats, family_ids=torch.from_numpy(family_ids)
    )


class Prefetch:
    """`next()` gives (batch, state): the batches of `source` in order, made in a background thread up to
    `depth` + 1 ahead (`depth` waiting, one being made), and the source's `state_dict()` right after each, which
    resumes the stream at the batch after it (the source itself is ahead by what the thread has made). `pin`:
    batches in pinned memory. An error in the source is raised by the `next()` that would have returned its
    batch. `close()` stops the thread."""

    def __init__(self, source, depth: int = 2, pin: bool = False):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source, pin), name="kestrel-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self, source, pin: bool) -> None:
        try:
            while not self._stop.is_set():
                batch = next(source)
                self._put((batch.pin_memory() if pin else batch, source.state_dict(), None))
        except BaseException as e:  # handed to the consumer, which raises it
            self._put((None, None, e))

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Batch, dict]:
        if self._stop.is_set():
            raise StopIteration
        batch, state, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        return batch, state

    def close(self, timeout: float = 60.0) -> bool:
        """Stop the thread and wait for it to finish the batch it is making, if any, at most `timeout` seconds;
        whether it stopped (a source stuck for good, e.g. on a dead worker pool, leaves a daemon thread)."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


# ---- worker processes -------------------------------------------------------------------------------------

_WORKER: _Renderer | None = None


def _worker_init(spec) -> None:
    global _WORKER
    # Ctrl-C is the trainer's to handle: a worker killed by it loses its task, and the batch being made would
    # wait for it forever
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    tokenizer_source, config, family_seed = spec
    _WORKER = _Renderer(load_tokenizer(tokenizer_source), config, family_seed)


def _worker_render(task: tuple[int, int]) -> list[tuple[int, list[int], list[int], float, int]]:
    start, count = task
    return [(d.index, d.ids, d.mask, d.weight, d.family) for d in map(_WORKER, range(start, start + count))]
