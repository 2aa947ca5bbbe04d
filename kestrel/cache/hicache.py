"""HiCache: the prefix cache's lower tiers, pinned host memory and then a directory on disk.

When the GPU tier evicts a tree node, its data goes down a tier instead of being dropped: the KV rows of its pages
(every MLA layer's latent row and indexer key) and its KDA checkpoint (every KDA layer's recurrent state and conv
window). A full host tier moves its least recently used entries to disk; a full disk tier deletes its least
recently used entries. A hit in a lower tier is loaded back into fresh GPU pages and a fresh checkpoint slot before
the request that hit it runs. The tree (`kestrel.cache.radix`) decides what moves where and when; this file holds
the bytes and does the copies.

Storage unit: a block of `block_bytes` = one KV page of every MLA layer, laid out [kv rows of each layer | indexer
rows of each layer], each [page_size, W]. A node's KV entry takes one block per page; a checkpoint, flattened to
bytes, takes `state_blocks` blocks (the last one padded). The host tier is one arena of blocks allocated up front
(pinned with CUDA): the budget is exact and no eviction pins memory. The disk tier writes one raw file per entry;
an entry split in two (the tree splits a node) shares its file, which goes when neither half uses it.

Asynchrony with CUDA:
- to the host: the pages are gathered into a device buffer on the compute stream, so they can be handed out again
  at once, and copied to the arena on a copy stream; the entry keeps that copy's event, which whoever reads the
  blocks later waits for.
- back to the GPU: a load stream waits for the compute stream (the pages and slot it fills may still be read by work
  queued before), copies the blocks up and scatters them into the pools, then records an event; the scheduler admits
  the request only once the load reports done.
- disk reads run on a background thread into a pinned buffer; the copy up is issued when the read is done.
On CPU every copy is synchronous, apart from the disk reads. Writes to disk are synchronous (they land in the OS
page cache); they happen only when the host tier is full.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel.cache.kv_pool import KVPool
from kestrel.cache.state_pool import StatePool
from kestrel.utils.errors import KestrelError

LOWER_TIERS = ("host", "disk")


@dataclass(eq=False)
class DiskFile:
    path: Path
    nbytes: int
    refs: int = 1


@dataclass(eq=False)
class Entry:
    """A node's KV ("kv": one block per page) or checkpoint ("state") in a lower tier: host blocks, or a run of
    blocks of a disk file."""

    kind: str
    num_blocks: int
    blocks: list[int] | None = None  # host tier: arena blocks, in page order
    file: DiskFile | None = None  # disk tier: blocks first .. first + num_blocks - 1 of this file
    first: int = 0
    copied: object | None = None  # torch.cuda.Event: the copy that fills `blocks` has completed

    @property
    def tier(self) -> str:
        return "host" if self.blocks is not None else "disk"


class HostTier:
    """Fixed-size blocks in one arena [num_blocks, block_bytes] uint8, page-locked when `pin` (registered with
    CUDA rather than taken from the pinned allocator, which rounds sizes up to a power of two)."""

    def __init__(self, num_blocks: int, block_bytes: int, pin: bool):
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.arena = torch.empty(num_blocks, block_bytes, dtype=torch.uint8)
        if pin and self.arena.numel():
            cudart, ptr = torch.cuda.cudart(), self.arena.data_ptr()
            portable = 1  # cudaHostRegisterPortable: page-locked for every device's context
            torch.cuda.check_error(cudart.cudaHostRegister(ptr, self.arena.numel(), portable))
            weakref.finalize(self.arena, cudart.cudaHostUnregister, ptr)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack; low ids first, so runs stay contiguous

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def bytes_used(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_bytes

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class DiskTier:
    """Raw block files in a fresh folder under `directory` (removed with this object), at most `capacity_bytes`
    in all (the tree makes room before it writes). Reads run on a background thread."""

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int, pin: bool):
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.dir = Path(tempfile.mkdtemp(prefix="kestrel-hicache-", dir=directory))
        except OSError as e:
            raise KestrelError(f"cannot use {directory!r} for the disk cache tier: {e}") from None
        self.capacity_bytes, self.block_bytes, self.pin = capacity_bytes, block_bytes, pin
        self.bytes_used, self.num_files = 0, 0
        self._names = itertools.count()
        self._reader = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kestrel-hicache-read")
        self._cleanup = weakref.finalize(self, _remove_dir, self.dir, self._reader)

    @property
    def bytes_free(self) -> int:
        return self.capacity_bytes - self.bytes_used

    def write(self, data: torch.Tensor) -> DiskFile:
        """Write CPU blocks [n, block_bytes] to a new file."""
        path = self.dir / f"{next(self._names):08d}.bin"
        data.contiguous().numpy().tofile(path)
        self.bytes_used += data.numel()
        self.num_files += 1
        return DiskFile(path, data.numel())

    def read(self, file: DiskFile, first: int, num_blocks: int) -> concurrent.futures.Future:
        """Blocks first .. first + num_blocks - 1 of `file` as a CPU tensor [num_blocks, block_bytes], later."""
        return self._reader.submit(_read_blocks, file.path, first, num_blocks, self.block_bytes, self.pin)

    def release(self, file: DiskFile) -> None:
        file.refs -= 1
        if file.refs == 0:
            file.path.unlink(missing_ok=True)
            self.bytes_used -= file.nbytes
            self.num_files -= 1


def _read_blocks(path: Path, first: int, num_blocks: int, block_bytes: int, pin: bool) -> torch.Tensor:
    buf = torch.empty(num_blocks, block_bytes, dtype=torch.uint8, pin_memory=pin)
    with open(path, "rb") as f:
        f.seek(first * block_bytes)
        got = f.readinto(memoryview(buf.numpy()).cast("B"))
    if got != buf.numel():
        raise OSError(f"{path}: short read ({got} of {buf.numel()} bytes)")
    return buf


def _remove_dir(path: Path, reader: concurrent.futures.ThreadPoolExecutor) -> None:
    reader.shutdown(wait=True)
    shutil.rmtree(path, ignore_errors=True)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids: (first id, index of it in `ids`, length)."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append((ids[start], start, i - start))
            start = i
    return out


class HiCache:
    """The host and disk tiers of one engine, and the copies between them and the GPU pools."""

    def __init__(
        self,
        kv_pool: KVPool,
        checkpoint_pool: StatePool,
        host_bytes: int,
        disk_dir: str | None = None,
        disk_bytes: int = 0,
    ):
        self.kv_pool, self.checkpoint_pool = kv_pool, checkpoint_pool
        self.page_size = ps = kv_pool.page_size
        # every per-token tensor of the KV pool, each [rows, W] of any dtype, moved as raw bytes
        self._kv = [*kv_pool.kv.values(), *kv_pool.index_k.values(), *kv_pool.index_scale.values()]
        self._state = [
            t for i in checkpoint_pool.ssm for t in (checkpoint_pool.ssm[i], checkpoint_pool.conv[i])
        ]
        self.device = (self._kv or self._state)[0].device
        self.cuda = self.device.type == "cuda"
        self.page_bytes = sum(ps * t.shape[1] * t.element_size() for t in self._kv)
        self.state_bytes = sum(t[0].numel() * t.element_size() for t in self._state)
        self.block_bytes = self.page_bytes or self.state_bytes
        self.state_blocks = -(-self.state_bytes // self.block_bytes)
        if host_bytes < self.block_bytes:
            raise KestrelError(
                f"the host cache tier ({host_bytes} B) is smaller than one block ({self.block_bytes} B = one KV "
                "page of every MLA layer): raise it"
            )
        self.host = HostTier(host_bytes // self.block_bytes, self.block_bytes, pin=self.cuda)
        self.disk = DiskTier(disk_dir, disk_bytes, self.block_bytes, self.cuda) if disk_dir else None
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._load_stream = torch.cuda.Stream(self.device)
        self.num_entries: collections.Counter = collections.Counter()  # (tier, kind) -> entries
        self.reset_stats()

    def blocks_for(self, kind: str, num_pages: int = 0) -> int:
        return num_pages if kind == "kv" else self.state_blocks

    def nbytes(self, entry: Entry) -> int:
        return entry.num_blocks * self.block_bytes

    # -- GPU -> lower tiers ------------------------------------------------------------------------------------
    def save(self, kind: str, src, tier: str) -> Entry:
        """Copy KV pages (`src` a list of pages) or a checkpoint slot (`src` a slot) into `tier`, where the tree
        has made room. The GPU pages or slot may be reused as soon as this returns."""
        data = self._gather_kv(src) if kind == "kv" else self._gather_state(src)  # [n, block_bytes] on device
        entry = Entry(kind, data.shape[0])
        if tier == "host":
            entry.blocks = self.host.alloc(entry.num_blocks)
            assert entry.blocks is not None, "save to the host tier without room"
            if self.cuda:
                gathered = torch.cuda.Event()
                gathered.record()
                with torch.cuda.stream(self._copy_stream):
                    self._copy_stream.wait_event(gathered)
                    self._copy_to_host(data, entry.blocks)
                    data.record_stream(self._copy_stream)
                    entry.copied = torch.cuda.Event()
                    entry.copied.record()
            else:
                self._copy_to_host(data, entry.blocks)
        else:
            assert self.nbytes(entry) <= self.disk.bytes_free, "save to the disk tier without room"
            entry.file = self.disk.write(data.cpu())
        self.num_entries[tier, kind] += 1
        self.num_saved[tier] += 1
        return entry

    def spill(self, entry: Entry) -> None:
        """Move a host entry to disk (the tree has made room there)."""
        assert entry.tier == "host" and self.nbytes(entry) <= self.disk.bytes_free
        if entry.copied is not None:
            entry.copied.synchronize()
        entry.file, entry.first = self.disk.write(self.host.arena[torch.tensor(entry.blocks)]), 0
        self.host.free(entry.blocks)
        entry.blocks, entry.copied = None, None
        self.num_entries["host", entry.kind] -= 1
        self.num_entries["disk", entry.kind] += 1
        self.num_spilled += 1

    def drop(self, entry: Entry) -> None:
        # Host blocks may still be the target of an offload copy: whoever gets them next either copies on the same
        # stream (after it) or waits for its own entry's event, recorded later on that stream.
        self.num_entries[entry.tier, entry.kind] -= 1
        if entry.blocks is not None:
            self.host.free(entry.blocks)
        else:
            self.disk.release(entry.file)
        entry.blocks, entry.file = None, None

    def split(self, entry: Entry, k: int) -> Entry:
        """Cut a KV entry after `k` blocks: returns the head, `entry` keeps the tail."""
        assert entry.kind == "kv" and 0 < k < entry.num_blocks
        head = Entry("kv", k, copied=entry.copied)
        if entry.blocks is not None:
            head.blocks, entry.blocks = entry.blocks[:k], entry.blocks[k:]
        else:
            head.file, head.first = entry.file, entry.first
            entry.file.refs += 1
            entry.first += k
        entry.num_blocks -= k
        self.num_entries[entry.tier, "kv"] += 1
        return head

    # -- lower tiers -> GPU ------------------------------------------------------------------------------------
    def load(self, items: list[tuple[Entry, object]]) -> Load:
        """Start copying each entry into its target (fresh KV pages for "kv", a checkpoint slot for "state").
        The entries are the load's now; they are freed when it is done."""
        self.num_loads += 1
        for entry, _ in items:
            self.loaded_bytes[entry.tier] += self.nbytes(entry)
        return Load(self, items)

    def _upload(self, load: Load, entry: Entry, data: torch.Tensor | None, dst) -> None:
        """Copy an entry's blocks (from the arena, or `data` read from disk) into the pools."""
        if not self.cuda:
            data = self.host.arena[torch.tensor(entry.blocks)] if data is None else data
            return self._scatter(entry.kind, data, dst)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._load_stream):
            self._load_stream.wait_stream(compute)
            if entry.copied is not None:
                self._load_stream.wait_event(entry.copied)
            staging = torch.empty(entry.num_blocks, self.block_bytes, dtype=torch.uint8, device=self.device)
            if data is None:
                for block, i, n in _runs(entry.blocks):
                    staging[i : i + n].copy_(self.host.arena[block : block + n], non_blocking=True)
            else:
                staging.copy_(data, non_blocking=True)
            self._scatter(entry.kind, staging, dst)
            load._event = torch.cuda.Event()
            load._event.record()

    # -- copies -----------------------------------------------------------------------------------------------
    def _index(self, ids: list[int]) -> torch.Tensor:
        """Ids as a device index, copied without a host sync (a plain copy would wait for the whole stream)."""
        t = torch.tensor(ids, dtype=torch.long)
        return t.pin_memory().to(self.device, non_blocking=True) if self.cuda else t

    def _gather_kv(self, pages: list[int]) -> torch.Tensor:
        n, ps = len(pages), self.page_size
        idx = self._index(pages)
        parts = [_bytes(t).view(-1, ps, _bytes(t).shape[1])[idx].reshape(n, -1) for t in self._kv]
        return torch.cat(parts, dim=1)  # [n, block_bytes]

    def _gather_state(self, slot: int) -> torch.Tensor:
        flat = torch.cat([t[slot].reshape(-1).view(torch.uint8) for t in self._state])  # [state_bytes]
        pad = self.state_blocks * self.block_bytes - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(self.state_blocks, self.block_bytes)

    def _scatter(self, kind: str, data: torch.Tensor, dst) -> None:
        """Write blocks [n, block_bytes] (on the pools' device) into KV pages (`dst` a list) or a slot."""
        if kind == "state":
            flat, off = data.reshape(-1), 0
            for t in self._state:
                row = t[dst].view(-1).view(torch.uint8)  # the slot's bytes, a view into the pool
                row.copy_(flat[off : off + row.numel()])
                off += row.numel()
            return
        n, ps = len(dst), self.page_size
        idx = self._index(dst)
        off = 0
        for t in self._kv:
            raw = _bytes(t)  # [rows, W * element size] uint8, a view into the pool
            w = ps * raw.shape[1]
            raw.view(-1, ps, raw.shape[1])[idx] = data[:, off : off + w].reshape(n, ps, raw.shape[1])
            off += w

    def _copy_to_host(self, data: torch.Tensor, blocks: list[int]) -> None:
        for block, i, n in _runs(blocks):
            self.host.arena[block : block + n].copy_(data[i : i + n], non_blocking=self.cuda)

    # -- introspection ----------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """The save, spill and load counters back to zero (at start, and after the engine's warm-up)."""
        self.num_saved = collections.Counter()  # tier -> entries written to it from the GPU
        self.num_spilled = 0  # host entries moved to disk
        self.loaded_bytes = collections.Counter()  # tier -> bytes loaded back to the GPU from it
        self.num_loads = 0

    def stats(self) -> dict:
        disk = self.disk
        return {
            "host_bytes": self.host.num_blocks * self.block_bytes,
            "host_bytes_used": self.host.bytes_used,
            "disk_bytes": disk.capacity_bytes if disk else 0,
            "disk_bytes_used": disk.bytes_used if disk else 0,
            "disk_files": disk.num_files if disk else 0,
            "host_checkpoints": self.num_entries["host", "state"],
            "disk_checkpoints": self.num_entries["disk", "state"],
            "num_loads": self.num_loads,
            "host_loaded_bytes": self.loaded_bytes["host"],
            "disk_loaded_bytes": self.loaded_bytes["disk"],
            "host_saves": self.num_saved["host"],
            "disk_saves": self.num_saved["disk"] + self.num_spilled,
        }

    def check(self, entries: list[Entry]) -> None:
        """The entries the tree and the loads in flight hold are exactly what the tiers hold (tests)."""
        blocks = [b for e in entries if e.blocks is not None for b in e.blocks]
        assert len(blocks) == len(set(blocks)) == self.host.num_blocks - self.host.num_free_blocks
        for e in entries:
            assert e.num_blocks == (len(e.blocks) if e.blocks is not None else e.num_blocks) > 0
        counts = collections.Counter((e.tier, e.kind) for e in entries)
        assert counts == +self.num_entries, (counts, self.num_entries)
        if self.disk is not None:
            files = collections.Counter(id(e.file) for e in entries if e.file is not None)
            by_id = {id(e.file): e.file for e in entries if e.file is not None}
            assert all(by_id[i].refs == n and by_id[i].path.exists() for i, n in files.items())
            assert sum(f.nbytes for f in by_id.values()) == self.disk.bytes_used <= self.disk.capacity_bytes
            assert len(by_id) == self.disk.num_files == len(list(self.disk.dir.iterdir()))


class Load:
    """Entries on their way back to the GPU. `poll()` is True once every copy has landed (and the entries are
    freed); until then the pages and slot it fills must not be read."""

    def __init__(self, store: HiCache, items: list[tuple[Entry, object]]):
        self.store, self.items = store, items
        self.done = False
        # filled in by the tree: prompt tokens per source tier, and the GPU pages the load fills
        self.tokens = {tier: 0 for tier in LOWER_TIERS}
        self.num_pages = 0
        self._event = None  # the last copy issued on the load stream
        self._reads: list[tuple[concurrent.futures.Future, Entry, object]] = []
        self._buffers: list[torch.Tensor] = []  # disk reads, kept alive until their copy is done
        for entry, dst in items:
            if entry.tier == "host":
                store._upload(self, entry, None, dst)
            else:
                self._reads.append((store.disk.read(entry.file, entry.first, entry.num_blocks), entry, dst))

    def poll(self) -> bool:
        if self.done:
            return True
        pending = []
        for future, entry, dst in self._reads:
            if future.done():
                data = future.result()
                self._buffers.append(data)
                self.store._upload(self, entry, data, dst)
            else:
                pending.append((future, entry, dst))
        self._reads = pending
        if pending or (self._event is not None and not self._event.query()):
            return False
        self.done = True
        for entry, _ in self.items:
            self.store.drop(entry)
        self._buffers.clear()
        return True

    def wait(self, timeout: float) -> None:
        """Block until something of this load may have progressed (or `timeout` seconds)."""
        if self._reads:
            futures = [f for f, _, _ in self._reads]
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        elif self._event is not None:
            self._event.synchronize()

    def entries(self) -> list[Entry]:
        return [] if self.done else [e for e, _ in self.items]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A [rows, W] pool tensor as its raw bytes [rows, W * element size] (a view)."""
    return t.view(torch.uint8)
