"""Prefix cache for a hybrid model: a radix tree over page-aligned token prefixes, holding the KV pages of the
MLA/DSA layers, with KDA state checkpoints attached to some of its nodes.

A node stands for the prefix that ends where its edge ends (`depth` tokens, a multiple of the page size); its
edge holds `len(tokens) / page_size` KV pages. A checkpoint (a slot of the checkpoint pool) on a node is the
KDA recurrent and conv state after exactly `depth` tokens. KV pages can be reused at any page boundary, but a
request can only resume where a checkpoint exists, so `match` returns the deepest node that has both.

Ownership: the tree holds one reference on each page of its nodes (kv_pool refcounts) and owns its checkpoint
slots. A request that reuses a prefix takes its own page references and locks the path, so eviction never
drops a node under a running request. Eviction is LRU, separately for leaves (KV pages) and for checkpoints.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kestrel.cache.kv_pool import KVPool


@dataclass(eq=False)
class Node:
    parent: Node | None
    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    depth: int = 0
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    checkpoint: int | None = None
    lock: int = 0
    last_access: int = 0

    def is_leaf(self) -> bool:
        return not self.children


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


class RadixCache:
    def __init__(self, kv_pool: KVPool, checkpoint_pool, page_size: int):
        self.kv_pool, self.checkpoint_pool, self.page_size = kv_pool, checkpoint_pool, page_size
        self.root = Node(parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree holds a reference on
        self.hit_tokens = 0
        self.query_tokens = 0

    # -- lookup -----------------------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int | None = None) -> Match:
        """Longest cached page-aligned prefix of `tokens`; a resume point strictly shorter than `limit`
        (default: len(tokens), so that at least one token is left to compute)."""
        limit = len(tokens) if limit is None else limit
        ps, node, now = self.page_size, self.root, next(self._clock)
        path: list[Node] = []
        resume: Node | None = None
        pos = 0
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            common = self._common_pages(child.tokens, tokens, pos)
            if common < len(child.tokens):
                child = self._split(child, common)  # the match ends inside the edge: make it a node
            node = child
            node.last_access = now
            path.append(node)
            pos += len(node.tokens)
            if node.checkpoint is not None and node.depth < limit:
                resume = node
        resume_len = resume.depth if resume is not None else 0
        return Match(path, pos, resume, resume_len, page_size=ps)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (the hit-rate metrics)."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def _common_pages(self, edge: tuple[int, ...], tokens: list[int], pos: int) -> int:
        """Tokens of `edge` that match `tokens[pos:]`, in whole pages."""
        ps, n = self.page_size, 0
        while (
            n + ps <= len(edge)
            and pos + n + ps <= len(tokens)
            and edge[n : n + ps] == tuple(tokens[pos + n : pos + n + ps])
        ):
            n += ps
        return n

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s edge after `at` tokens: a new parent node takes the first part (no checkpoint)."""
        ps = self.page_size
        top = Node(
            node.parent,
            node.tokens[:at],
            node.pages[: at // ps],
            node.depth - len(node.tokens) + at,
            lock=node.lock,
            last_access=node.last_access,
        )
        node.parent.children[node.tokens[:ps]] = top
        node.tokens, node.pages, node.parent = node.tokens[at:], node.pages[at // ps :], top
        top.children[node.tokens[:ps]] = node
        return top

    # -- insertion --------------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> Node:
        """Add the prefix `tokens` (a multiple of the page size) whose KV lives in `pages`. The tree takes its
        own reference on pages it did not hold; returns the node at depth len(tokens)."""
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) >= len(tokens) // ps, "insert needs whole pages"
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            key = tuple(tokens[pos : pos + ps])
            child = node.children.get(key)
            if child is None:
                rest = tuple(tokens[pos:])
                new_pages = pages[pos // ps : len(tokens) // ps]
                self.kv_pool.incref(new_pages)
                self.num_pages += len(new_pages)
                child = Node(node, rest, list(new_pages), node.depth + len(rest), last_access=now)
                node.children[key] = child
                return child
            common = self._common_pages(child.tokens, tokens, pos)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + len(child.tokens)
        return node

    def attach_checkpoint(self, node: Node, slot: int) -> bool:
        """Give `node` the checkpoint in `slot` (ownership passes to the tree). False (and the caller keeps the
        slot) when the node already has one."""
        if node is self.root or node.checkpoint is not None:
            return False
        node.checkpoint = slot
        return True

    # -- locking ----------------------------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            assert node.lock > 0, "unlock of an unlocked node"
            node.lock -= 1
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------------------------
    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]

    def evict_pages(self, needed: int) -> int:
        """Drop least recently used unlocked leaves until `needed` pages are back in the free list (or nothing
        more can go). Returns the number of pages freed."""
        before = self.kv_pool.num_free_pages
        while self.kv_pool.num_free_pages - before < needed:
            leaves = [n for n in self._nodes() if n.is_leaf() and n.lock == 0]
            if not leaves:
                break
            self._remove(min(leaves, key=lambda n: n.last_access))
        return self.kv_pool.num_free_pages - before

    def evict_checkpoints(self, needed: int) -> int:
        """Free `needed` checkpoint slots, least recently used first, skipping locked nodes."""
        freed = 0
        while freed < needed:
            holders = [n for n in self._nodes() if n.checkpoint is not None and n.lock == 0]
            if not holders:
                break
            node = min(holders, key=lambda n: n.last_access)
            self.checkpoint_pool.free(node.checkpoint)
            node.checkpoint = None
            freed += 1
        return freed

    def _remove(self, node: Node) -> None:
        if node.checkpoint is not None:
            self.checkpoint_pool.free(node.checkpoint)
        self.kv_pool.free(node.pages)
        self.num_pages -= len(node.pages)
        del node.parent.children[node.tokens[: self.page_size]]

    def flush(self) -> None:
        """Drop every unlocked node (all of them when no request runs)."""
        while True:
            leaves = [n for n in self._nodes() if n.is_leaf() and n.lock == 0]
            if not leaves:
                return
            for leaf in leaves:
                self._remove(leaf)

    # -- invariants (tests) -----------------------------------------------------------------------------------
    def check(self) -> None:
        total = 0
        for node in self._nodes():
            assert len(node.tokens) % self.page_size == 0 and len(node.tokens) > 0
            assert len(node.pages) == len(node.tokens) // self.page_size
            assert node.depth == node.parent.depth + len(node.tokens)
            assert node.parent.children[node.tokens[: self.page_size]] is node
            assert node.lock >= 0 and all(c.lock <= node.lock for c in node.children.values())
            for p in node.pages:
                assert self.kv_pool.refcount[p] >= 1
            total += len(node.pages)
        assert total == self.num_pages
