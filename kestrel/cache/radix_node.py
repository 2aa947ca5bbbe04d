"""The radix tree's parts (`kestrel.cache.radix`): `Node`, a page-aligned prefix with its KV pages, its KDA
checkpoint and the lower-tier entries holding either; `Match`, what a lookup found (reusable KV, the deepest
checkpoint to resume from) and whether resuming needs a load from a lower tier first."""

from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.cache.hicache import Entry, Load


@dataclass(eq=False)
class Node:
    parent: Node | None
    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    depth: int = 0
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    checkpoint: int | None = None  # a slot of the (GPU) checkpoint pool
    lock: int = 0  # requests using the path: its KV pages stay
    pins: int = 0  # requests about to restore this checkpoint (or holding a load of it): it stays
    last_access: int = 0
    kv_entry: Entry | None = None  # the KV in a lower tier (then `pages` is empty)
    state_entry: Entry | None = None  # the checkpoint in a lower tier (then `checkpoint` is None)
    loading: Load | None = None  # the load that fills its pages or checkpoint

    def is_leaf(self) -> bool:
        return not self.children

    @property
    def tier(self) -> str:
        """Where the node's KV lives."""
        return "gpu" if self.kv_entry is None else self.kv_entry.tier

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None or self.state_entry is not None

    def in_flight(self) -> bool:
        """A load is still writing this node's pages or checkpoint."""
        if self.loading is not None and self.loading.done:
            self.loading = None
        return self.loading is not None


@dataclass
class Match:
    """The result of a lookup: reusable KV up to `kv_len` tokens (the nodes on `path`), and the deepest node
    with a checkpoint, usable to resume at `resume_len` tokens (0 = nothing to resume from)."""

    path: list[Node]
    kv_len: int
    resume_node: Node | None
    resume_len: int

    def pages(self, upto: int) -> list[int]:
        """The KV pages of the first `upto` tokens (a multiple of the page size, <= kv_len)."""
        out: list[int] = []
        for node in self.path:
            out += node.pages
        return out[: upto // self.page_size] if upto else []

    page_size: int = 1

    def resume_path(self) -> list[Node]:
        return [n for n in self.path if n.depth <= self.resume_len]

    @property
    def needs_load(self) -> bool:
        """Part of what resuming needs (the path's KV, the checkpoint) is in a lower tier."""
        node = self.resume_node
        if node is None:
            return False
        return node.checkpoint is None or any(n.tier != "gpu" for n in self.resume_path())

    @property
    def in_flight(self) -> bool:
        """A load is still bringing part of the resume path to the GPU."""
        return any(n.in_flight() for n in self.resume_path())
