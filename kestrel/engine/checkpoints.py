"""The prefix cache's KDA state checkpoints around an engine step: what a step restores before it runs, where
its prefill chunks save states inside the forward, and what it hands to the cache after it.

A linear-attention layer cannot resume from KV pages alone: a cached prefix is usable only at positions where
the KDA states were saved. The scheduler plans those positions (`Request.checkpoint_at`); this module moves the
states between a request's slot in the state pool and the checkpoint pool at the right moments, and inserts the
saved ones into the radix tree with the KV they go with.
"""

from __future__ import annotations

from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import StatePool, copy_state
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Batch


class Checkpoints:
    def __init__(self, cache: RadixCache, state_pool: StatePool, checkpoint_pool: StatePool, page_size: int):
        self.cache, self.state_pool, self.pool, self.page_size = cache, state_pool, checkpoint_pool, page_size

    def before_step(self, batch: Batch) -> None:
        """A request resuming from a cached prefix starts from a copy of the checkpoint's state; each planned
        checkpoint inside a prefill chunk gets a checkpoint slot (none left: that one is skipped), where the KDA
        layers write the state during the step."""
        for chunk in batch.prefill:
            req = chunk.request
            if req.restore_from is not None:
                copy_state(self.pool, req.restore_from, self.state_pool, req.slot)
                req.restore_from = None
                self.cache.unpin(req.cache_node)  # the checkpoint may go now: the state is in the slot
        for chunk in batch.prefill:  # after every restore: taking a slot may evict an unpinned checkpoint
            inside = [p for p in chunk.request.checkpoint_at if chunk.start < p < chunk.end]
            chunk.saves = [(p, slot) for p in inside if (slot := self._slot()) is not None]

    def after_step(self, batch: Batch) -> None:
        """Once the step's positions count as computed: prefill chunks that ended at a planned position save their
        state into the tree with their KV; decode steps that completed a page keep the state in the request's
        tracking slot (the copy is queued on the stream behind the step, before anything launched after it)."""
        for chunk in batch.prefill:
            req = chunk.request
            for p, slot in chunk.saves:  # saved inside the chunk during the step
                self._insert(req, p, slot)
            if chunk.end in req.checkpoint_at and (slot := self._slot()) is not None:
                copy_state(self.state_pool, req.slot, self.pool, slot)
                self._insert(req, chunk.end, slot)
        for req in batch.decode:
            if req.num_computed % self.page_size == 0:
                if req.track_slot is None:
                    req.track_slot = self._slot()
                if req.track_slot is not None:
                    copy_state(self.state_pool, req.slot, self.pool, req.track_slot)
                    req.track_len = req.num_computed

    def _slot(self) -> int | None:
        slot = self.pool.alloc()
        if slot is None and self.cache.evict_checkpoints(1):
            slot = self.pool.alloc()
        return slot

    def _insert(self, req: Request, length: int, slot: int) -> None:
        """The request's first `length` tokens into the tree with the checkpoint in `slot` (freed if the tree
        already holds one there)."""
        if not self.cache.insert_with_checkpoint(req.all_ids[:length], req.pages, slot):
            self.pool.free(slot)
