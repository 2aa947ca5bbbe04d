"""Prefix cache for a hybrid model: a radix tree over page-aligned token prefixes, holding the KV pages of the
MLA/DSA layers, with KDA state checkpoints attached to some of its nodes.

A node stands for the prefix that ends where its edge ends (`depth` tokens, a multiple of the page size); its
edge holds `len(tokens) / page_size` KV pages. A checkpoint (a slot of the checkpoint pool) on a node is the
KDA recurrent and conv state after exactly `depth` tokens. KV pages can be reused at any page boundary, but a
request can only resume where a checkpoint exists, so `match` returns the deepest node that has both.

Ownership: the tree holds one reference on each page of its nodes (kv_pool refcounts) and owns its checkpoint
slots. A request that reuses a prefix takes its own page references and locks the path, so eviction never
drops a node under a running request. Eviction is LRU, separately for leaves (KV pages) and for checkpoints.

Lower tiers (HiCache, `tiers`): eviction then moves a node's KV and checkpoint down to host memory instead of
dropping them, a full host tier moves its LRU entries to disk, and a full disk tier deletes its LRU entries. A
node keeps its place and its edge whatever tier holds its data (`Node.tier`), so `match` still finds it; tiers
only get lower going down the tree, so each tier evicts from its own frontier. A hit whose resume path is partly
in a lower tier is `load`ed back into fresh pages and a fresh checkpoint slot before the request may use it;
the load locks the path until it is done, and marks its nodes `loading` meanwhile. A checkpoint can also go
down alone (`evict_checkpoints`) while the node's KV stays on the GPU.
"""

from __future__ import annotations

import heapq
import itertools

from kestrel.cache.hicache import LOWER_TIERS, Entry, HiCache, Load
from kestrel.cache.kv_pool import KVPool
from kestrel.cache.radix_node import Match, Node

TIER_RANK = {"gpu": 0, "host": 1, "disk": 2}


class RadixCache:
    def __init__(self, kv_pool: KVPool, checkpoint_pool, page_size: int, tiers: HiCache | None = None):
        self.kv_pool, self.checkpoint_pool, self.page_size = kv_pool, checkpoint_pool, page_size
        self.tiers = tiers
        self.root = Node(parent=None)
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree holds a reference on
        self.hit_tokens = 0
        self.query_tokens = 0
        self.tier_hit_tokens = {"gpu": 0, "host": 0, "disk": 0}  # by where the hit's KV was at lookup
        self.loads: list[tuple[Load, Node]] = []  # in flight, with the node each one locks
        self.num_loading_pages = 0  # of num_pages, those loads in flight fill: the tree's alone, but not free

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
            if node.has_checkpoint and node.depth < limit:
                resume = node
        resume_len = resume.depth if resume is not None else 0
        return Match(path, pos, resume, resume_len, page_size=ps)

    def reset_stats(self) -> None:
        """The hit-rate counters, and the lower tiers' save, spill and load counters, back to zero (after the
        engine's warm-up)."""
        self.hit_tokens = self.query_tokens = 0
        self.tier_hit_tokens = dict.fromkeys(self.tier_hit_tokens, 0)
        if self.tiers is not None:
            self.tiers.reset_stats()

    def record(self, query_tokens: int, hit_tokens: int, load: Load | None = None) -> None:
        """Count one admitted request's lookup (the hit-rate metrics); `load`: the load that brought part of its
        prefix up from a lower tier."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens
        rest = hit_tokens
        for tier in LOWER_TIERS:
            n = min(load.tokens[tier], rest) if load is not None else 0
            self.tier_hit_tokens[tier] += n
            rest -= n
        self.tier_hit_tokens["gpu"] += rest

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
            loading=node.loading,
        )
        if node.kv_entry is not None:
            top.kv_entry = self.tiers.split(node.kv_entry, at // ps)
        node.parent.children[node.tokens[:ps]] = top
        node.tokens, node.pages, node.parent = node.tokens[at:], node.pages[at // ps :], top
        top.children[node.tokens[:ps]] = node
        return top

    # -- insertion --------------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int]) -> Node:
        """Add the prefix `tokens` (a multiple of the page size) whose KV lives in `pages`. The tree takes its
        own reference on pages it did not hold (nodes whose KV was in a lower tier take these pages instead);
        returns the node at depth len(tokens)."""
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
            if child.kv_entry is not None:
                self._adopt(child, pages[pos // ps : (pos + len(child.tokens)) // ps])
            child.last_access = now
            node, pos = child, pos + len(child.tokens)
        return node

    def insert_with_checkpoint(self, tokens: list[int], pages: list[int], slot: int) -> bool:
        """`insert`, then `attach_checkpoint` at the inserted node: whether the tree took the slot."""
        return self.attach_checkpoint(self.insert(tokens, pages), slot)

    def _adopt(self, node: Node, pages: list[int]) -> None:
        """A node whose KV is in a lower tier takes a request's pages holding the same KV."""
        self.kv_pool.incref(pages)
        self.num_pages += len(pages)
        self.tiers.drop(node.kv_entry)
        node.kv_entry, node.pages = None, list(pages)

    def attach_checkpoint(self, node: Node, slot: int) -> bool:
        """Give `node` the checkpoint in `slot` (ownership passes to the tree). False (and the caller keeps the
        slot) when the node already has one on the GPU; a copy in a lower tier is replaced."""
        if node is self.root or node.checkpoint is not None:
            return False
        assert node.tier == "gpu", "a checkpoint on a node whose KV is not on the GPU"
        if node.state_entry is not None:
            self.tiers.drop(node.state_entry)
            node.state_entry = None
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

    def pin(self, node: Node) -> None:
        """Keep the node's checkpoint until `unpin`: a request will copy it into its state slot. (A lock keeps
        a path's KV; a checkpoint on a locked path may still go once nobody is about to restore it: a running
        conversation has its state in its own slot.)"""
        node.pins += 1

    def unpin(self, node: Node) -> None:
        assert node.pins > 0, "unpin of an unpinned node"
        node.pins -= 1

    # -- loads from the lower tiers ---------------------------------------------------------------------------
    def load(self, match: Match) -> Load | None:
        """Start bringing the lower-tier part of the match's resume path up: the KV of its nodes into fresh
        pages, the resume node's checkpoint into a fresh slot. The path is locked until the load is done
        (`poll_loads`). None, with nothing moved, when the GPU has no room for it."""
        node, ps = match.resume_node, self.page_size
        lower = [n for n in match.resume_path() if n.tier != "gpu"]
        need = sum(len(n.tokens) for n in lower) // ps
        self.lock(node)  # our own evictions below must leave the path alone
        if self.kv_pool.num_free_pages < need:
            self.evict_pages(need - self.kv_pool.num_free_pages)
        slot = None
        if self.kv_pool.num_free_pages >= need and node.checkpoint is None:
            slot = self.checkpoint_pool.alloc()
            if slot is None and self.evict_checkpoints(1):
                slot = self.checkpoint_pool.alloc()
        if self.kv_pool.num_free_pages < need or (node.checkpoint is None and slot is None):
            self.unlock(node)
            return None
        pages = self.kv_pool.alloc(need)
        items: list[tuple[Entry, object]] = []
        tokens = {tier: 0 for tier in LOWER_TIERS}
        for n in lower:
            n.pages, pages = pages[: len(n.tokens) // ps], pages[len(n.tokens) // ps :]
            items.append((n.kv_entry, n.pages))
            tokens[n.kv_entry.tier] += len(n.tokens)
            n.kv_entry = None
            self.num_pages += len(n.pages)
        if slot is not None:
            items.append((node.state_entry, slot))
            node.checkpoint, node.state_entry = slot, None
        load = self.tiers.load(items)
        load.tokens, load.num_pages = tokens, need
        self.num_loading_pages += need
        for n in lower + [node]:
            n.loading = load
        self.loads.append((load, node))
        self.poll_loads()
        return load

    def poll_loads(self) -> None:
        """Finish the loads whose copies have landed: their paths are unlocked."""
        for load, node in list(self.loads):
            if load.poll():
                self.loads.remove((load, node))
                self.num_loading_pages -= load.num_pages
                self.unlock(node)

    def wait_for_loads(self, timeout: float = 0.005) -> None:
        """Nothing else to do: block until the oldest load may have progressed."""
        if self.loads:
            self.loads[0][0].wait(timeout)

    # -- eviction ---------------------------------------------------------------------------------------------
    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]

    def evict_pages(self, needed: int) -> int:
        """Evict least recently used unlocked nodes of the GPU tier's frontier (no child on the GPU) until `needed`
        pages are back in the free list (or nothing more can go): down to the host tier, or dropped without one.
        Nodes whose pages a running request shares free nothing, so they stay. Returns the pages freed."""
        before = self.kv_pool.num_free_pages
        # One walk of the tree, then a heap by last use: demoting a node can only make its parent a candidate
        # (nothing else changes during the loop), so this picks the nodes the per-page rescan picked, without
        # a walk of the whole tree for each (64 pages over 1,536 nodes on this CPU: 12.2 ms before, 1.2 ms now).
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self._nodes() if self._evictable(n)]
        heapq.heapify(heap)
        while heap and self.kv_pool.num_free_pages - before < needed:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._demote(node)
            if parent is not self.root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return self.kv_pool.num_free_pages - before

    def _evictable(self, n: Node) -> bool:
        """A GPU-tier frontier node (no child on the GPU), unlocked, whose pages no running request shares."""
        return (
            n.tier == "gpu"
            and n.lock == 0
            and not any(c.tier == "gpu" for c in n.children.values())
            and all(self.kv_pool.refcount[p] == 1 for p in n.pages)
        )

    def _superseded(self) -> set[Node]:
        """Nodes on a chain (one child) below which a deeper node holds a GPU checkpoint: a conversation that
        grew past them resumes from that deeper one, so theirs serve only a new branch off the middle. Branch
        points (a shared system prompt, sessions that diverged) are not superseded: new branches start there."""
        covered: set[Node] = set()
        for node in self._nodes():
            if node.checkpoint is None:
                continue
            up = node.parent
            while up is not None and up is not self.root and len(up.children) == 1 and up not in covered:
                covered.add(up)
                up = up.parent
        return covered

    def evict_checkpoints(self, needed: int) -> int:
        """Free `needed` checkpoint slots, skipping pinned ones and those a load is still writing: superseded
        checkpoints first (a deeper one on the same path holds more of the conversation), least recently used
        first within each kind; the checkpoints go down to a lower tier where there is one. Locks do not keep
        checkpoints (only pins do): a running request's path often holds its earlier, superseded ones."""
        freed = 0
        while freed < needed:
            holders = [
                n for n in self._nodes() if n.checkpoint is not None and n.pins == 0 and not n.in_flight()
            ]
            if not holders:
                break
            covered = self._superseded()
            node = min(holders, key=lambda n: (n not in covered, n.last_access))
            if self.tiers is not None:
                node.state_entry = self._save("state", node.checkpoint)
            self.checkpoint_pool.free(node.checkpoint)
            node.checkpoint = None
            freed += 1
        return freed

    def _demote(self, node: Node) -> None:
        """Move a GPU-frontier node's KV (and checkpoint) to a lower tier, or drop it (with its subtree)."""
        kv = self._save("kv", node.pages) if self.tiers is not None else None
        if kv is None:
            return self._remove_subtree(node)
        if node.checkpoint is not None:
            node.state_entry = self._save("state", node.checkpoint)
            self.checkpoint_pool.free(node.checkpoint)
            node.checkpoint = None
        self.kv_pool.free(node.pages)
        self.num_pages -= len(node.pages)
        node.pages, node.kv_entry = [], kv

    def _save(self, kind: str, src) -> Entry | None:
        """Copy GPU data down: to the host tier, or straight to disk when the host cannot take it."""
        n = self.tiers.blocks_for(kind, len(src) if kind == "kv" else 0)
        if self._host_room(n):
            return self.tiers.save(kind, src, "host")
        if self.tiers.disk is not None and self._disk_room(n * self.tiers.block_bytes):
            return self.tiers.save(kind, src, "disk")
        return None

    def _lru_entry(self, tier: str) -> tuple[Node, str] | None:
        """The least recently used entry of a lower tier that may leave it: a checkpoint, or the KV of a node
        with no child in this tier (none at all for disk), unlocked."""
        best: tuple[Node, str] | None = None
        for n in self._nodes():
            if n.lock:
                continue
            if n.state_entry is not None and n.state_entry.tier == tier:
                kind = "state"
            elif n.tier == tier and all(TIER_RANK[c.tier] > TIER_RANK[tier] for c in n.children.values()):
                kind = "kv"
            else:
                continue
            if best is None or n.last_access < best[0].last_access:
                best = (n, kind)
        return best

    def _host_room(self, blocks: int) -> bool:
        host = self.tiers.host
        if blocks > host.num_blocks:
            return False
        while host.num_free_blocks < blocks:
            victim = self._lru_entry("host")
            if victim is None:
                return False
            node, kind = victim
            entry = node.kv_entry if kind == "kv" else node.state_entry
            if self.tiers.disk is not None and self._disk_room(self.tiers.nbytes(entry)):
                self.tiers.spill(entry)
            else:
                self._drop(node, kind)
        return True

    def _disk_room(self, nbytes: int) -> bool:
        disk = self.tiers.disk
        if nbytes > disk.capacity_bytes:
            return False
        while disk.bytes_free < nbytes:
            victim = self._lru_entry("disk")
            if victim is None:
                return False
            self._drop(*victim)
        return True

    def _drop(self, node: Node, kind: str) -> None:
        if kind == "state":
            self.tiers.drop(node.state_entry)
            node.state_entry = None
        else:
            self._remove_subtree(node)

    def _remove_subtree(self, node: Node) -> None:
        for child in list(node.children.values()):
            self._remove_subtree(child)
        self._remove(node)

    def _remove(self, node: Node) -> None:
        assert node.is_leaf() and node.lock == 0
        if node.checkpoint is not None:
            self.checkpoint_pool.free(node.checkpoint)
        if node.state_entry is not None:
            self.tiers.drop(node.state_entry)
        if node.kv_entry is not None:
            self.tiers.drop(node.kv_entry)
        else:
            self.kv_pool.free(node.pages)
            self.num_pages -= len(node.pages)
        del node.parent.children[node.tokens[: self.page_size]]

    def flush(self) -> None:
        """Drop every unlocked node (all of them when no request runs), in every tier."""
        while True:
            leaves = [n for n in self._nodes() if n.is_leaf() and n.lock == 0]
            if not leaves:
                return
            for leaf in leaves:
                self._remove(leaf)

    # -- invariants (tests) -----------------------------------------------------------------------------------
    def check(self) -> None:
        total, shared, entries = 0, 0, []
        for node in self._nodes():
            assert len(node.tokens) % self.page_size == 0 and len(node.tokens) > 0
            assert node.depth == node.parent.depth + len(node.tokens)
            assert node.parent.children[node.tokens[: self.page_size]] is node
            assert node.lock >= 0 and all(c.lock <= node.lock for c in node.children.values())
            assert node.pins >= 0 and (node.pins == 0 or node.lock > 0), (
                "a pinned checkpoint's path is locked"
            )
            assert node.pins == 0 or node.checkpoint is not None, "a pinned checkpoint stays on the GPU"
            assert TIER_RANK[node.parent.tier] <= TIER_RANK[node.tier], "tiers only get lower down the tree"
            assert node.checkpoint is None or (node.tier == "gpu" and node.state_entry is None)
            assert not node.in_flight() or node.lock > 0, "a node under a load must be locked"
            if node.kv_entry is None:
                assert len(node.pages) == len(node.tokens) // self.page_size
                for p in node.pages:
                    assert self.kv_pool.refcount[p] >= 1
                shared += sum(self.kv_pool.refcount[p] > 1 for p in node.pages)
                total += len(node.pages)
            else:
                assert not node.pages and node.kv_entry.kind == "kv"
                assert node.kv_entry.num_blocks == len(node.tokens) // self.page_size
                entries.append(node.kv_entry)
            if node.state_entry is not None:
                assert node.state_entry.kind == "state"
                entries.append(node.state_entry)
        assert total == self.num_pages
        assert self.num_loading_pages == sum(load.num_pages for load, _ in self.loads)
        assert shared == self.kv_pool.num_shared, (
            "only the cache's pages are shared, and the count says how many"
        )
        if self.tiers is not None:
            self.tiers.check(entries + [e for load, _ in self.loads for e in load.entries()])
