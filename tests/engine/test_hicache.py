"""HiCache, the prefix cache's host and disk tiers: bytes survive the trip down and back (through splits), outputs
with the tiers on equal outputs with the cache off (temperature 0, tiny model) when prefixes come back from host
memory, from disk, or both, the hits really come from those tiers, the disk cap holds (LRU deletion), a flush
empties every tier, and a random interleaving ends with every pool back at baseline."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kestrel.cache import hicache
from kestrel.cache.hicache import HiCache
from kestrel.cache.kv_pool import KVPool
from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import StatePool
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.request import Status
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model
from kestrel.presets import preset_config
from kestrel.utils.errors import KestrelError

PS = 4
BLOCK = PS * 448  # one KV page of every MLA layer of `tiny` in fp32: the tiers' block
STATE_BLOCKS = 8  # a tiny fp32 checkpoint (12,800 B) in blocks
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=13)


@pytest.fixture(scope="module")
def reference(model):
    """Outputs with the cache off, memoized by prompt."""
    config = EngineConfig(
        model="tiny",
        page_size=PS,
        enable_prefix_cache=False,
        max_running_requests=3,
        kv_cache_bytes=128 * BLOCK,
    )
    engine = Engine(config, model=model)
    seen: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int], n: int) -> list[int]:
        if (tuple(prompt), n) not in seen:
            seen[tuple(prompt), n] = _generate(engine, prompt, n)
        return seen[tuple(prompt), n]

    return run


def _engine(model, pages: int, host_blocks: int, disk=None, disk_blocks: int = 0, **kw) -> Engine:
    kw.setdefault("max_running_requests", 3)
    kw.setdefault("checkpoint_interval", 0)
    kw.setdefault("num_checkpoints", 2)
    if disk is not None:
        kw.update(hicache_disk_dir=str(disk), hicache_disk_bytes=disk_blocks * BLOCK)
    config = EngineConfig(
        model="tiny", page_size=PS, kv_cache_bytes=pages * BLOCK, hicache_host_bytes=host_blocks * BLOCK, **kw
    )
    return Engine(config, model=model)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(engine: Engine, prompt: list[int], n: int) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
        if engine.cache is not None:
            engine.cache.check()
    return out


def _sessions(engine: Engine, reference, order: list[int], length: int = 22, n: int = 3) -> list[dict]:
    """Multi-turn sessions, one turn each time `order` names one (its reply and a short user message are
    appended); every output identical to cache off. Returns each turn's hit tokens by tier."""
    history = [_ids(length + s, 50 + s) for s in range(max(order) + 1)]
    hits = []
    for turn, s in enumerate(order):
        before = dict(engine.cache.tier_hit_tokens)
        out = _generate(engine, history[s], n)
        assert out == reference(history[s], n), (turn, s)
        hits.append({tier: v - before[tier] for tier, v in engine.cache.tier_hit_tokens.items()})
        history[s] = history[s] + out + [s, turn % 7]
    return hits


def _at_baseline(engine: Engine) -> None:
    """Idle and flushed: every GPU page, state slot, checkpoint slot and host block free, no file on disk."""
    engine.flush_cache()
    engine.cache.check()
    tiers = engine.cache.tiers
    assert engine.kv_pool.num_free_pages == engine.kv_pool.num_pages and engine.cache.num_pages == 0
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots
    assert engine.checkpoint_pool.num_free_slots == engine.checkpoint_pool.num_slots
    assert tiers.host.num_free_blocks == tiers.host.num_blocks and not engine.cache.root.children
    if tiers.disk is not None:
        assert tiers.disk.bytes_used == 0 and not list(tiers.disk.dir.iterdir())


# -- the tiers alone -----------------------------------------------------------------------------------------


def _randomize(pools) -> None:
    for t in pools:
        t.copy_(torch.randn(t.shape, device=t.device).to(t.dtype))  # also FP8 keys, which have no normal_()


@pytest.mark.parametrize("index_fp8", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_bytes_survive_host_disk_and_back(tmp_path, device, index_fp8):
    config = preset_config("tiny")
    kv = KVPool(config, 20, PS, torch.float32, device, index_fp8=index_fp8)
    ckpt = StatePool(config, 3, torch.float32, device, zero_on_alloc=False)
    key_tensors = (*kv.kv.values(), *kv.index_k.values(), *kv.index_scale.values())
    pools = [*key_tensors, *ckpt.ssm.values(), *ckpt.conv.values()]
    _randomize(pools)
    block = PS * KVPool.bytes_per_token(config, torch.float32, index_fp8)
    assert block == (BLOCK if not index_fp8 else PS * 2 * (40 * 4 + 16 + 4))  # 2 MLA layers, kv 40, DI 16
    state_blocks = -(-sum(t[0].numel() * t.element_size() for t in pools[len(key_tensors) :]) // block)
    host_blocks = 4 + state_blocks  # a's KV and checkpoint, no more
    tiers = HiCache(kv, ckpt, host_blocks * block, str(tmp_path), 100 * block)
    cache = RadixCache(kv, ckpt, PS, tiers)

    def add(tokens):
        pages = kv.alloc(len(tokens) // PS)
        node = cache.insert(tokens, pages)
        kv.free(pages)  # the request lets go; the tree keeps its reference
        assert cache.attach_checkpoint(node, ckpt.alloc())
        return node

    def snapshot(tokens):
        """KV rows of the whole prefix and the checkpoint at its end, as they are on the GPU now."""
        m = cache.match(tokens + [1])
        assert m.resume_len == len(tokens) and not m.needs_load
        rows = kv.token_rows(m.pages(len(tokens)), 0, len(tokens)).to(device)
        slot = m.resume_node.checkpoint
        return [t[rows].clone() for t in key_tensors] + [
            t[slot].clone() for t in (*ckpt.ssm.values(), *ckpt.conv.values())
        ]

    def bring_back(tokens):
        m = cache.match(tokens + [1])
        assert m.needs_load and cache.load(m) is not None
        while cache.loads:
            cache.wait_for_loads()
            cache.poll_loads()

    a, b = list(range(100, 116)), list(range(200, 224))  # 4 and 6 pages
    node_a, node_b = add(a), add(b)
    want_a, want_b = snapshot(a), snapshot(b)
    cache.lock(node_b)
    assert cache.evict_pages(4) == 4 and node_a.tier == "host" and node_a.state_entry.tier == "host"
    cache.unlock(node_b)
    assert cache.evict_pages(6) == 6 and node_b.tier != "gpu"  # a, least recently used, goes on to disk
    assert node_a.tier == "disk" and node_a.state_entry.tier == "disk" and ckpt.num_free_slots == 3
    cache.check()
    cache.match(b[:8] + [0] * 4)  # splits b's edge after 2 pages, wherever it lives
    cache.match(a[:4] + [0] * 4)  # and a's after 1 page, on disk
    assert node_a.parent.tier == "disk" and len(node_a.parent.tokens) == PS
    cache.check()
    _randomize(pools)  # the GPU copies are gone for good
    bring_back(a)
    bring_back(b)
    for got, want in zip(snapshot(a) + snapshot(b), want_a + want_b):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert tiers.num_loads == 2 and tiers.loaded_bytes["disk"] > 0
    cache.check()
    cache.flush()
    cache.check()
    assert kv.num_free_pages == 20 and ckpt.num_free_slots == 3 and tiers.host.num_free_blocks == host_blocks
    assert tiers.disk.bytes_used == 0 and not list(tiers.disk.dir.iterdir())


# -- identity: tiers on == cache off -------------------------------------------------------------------------


def test_reload_from_host(model, reference):
    # 16 GPU pages and 2 checkpoint slots for three sessions of ~7 pages: each turn pushes the others' prefixes
    # down to the host; each session's second turn resumes near its first turn's end, from the host
    engine = _engine(model, pages=16, host_blocks=400)
    hits = _sessions(engine, reference, [0, 1, 2, 0, 1, 2])
    assert all(h["host"] >= 20 and h["gpu"] == h["disk"] == 0 for h in hits[3:]), hits
    s = engine.cache_stats()
    assert s["cache_host_hit_tokens"] == s["cache_hit_tokens"] > 0 and s["cache_num_loads"] == 3
    _at_baseline(engine)


def test_reload_from_disk_and_flush(model, reference, tmp_path):
    # the host tier holds one checkpoint and two pages: what the GPU evicts moves on to disk at once
    engine = _engine(model, pages=16, host_blocks=STATE_BLOCKS + 2, disk=tmp_path, disk_blocks=400)
    hits = _sessions(engine, reference, [0, 1, 2, 0, 1, 2])
    assert all(h["disk"] >= 20 and h["gpu"] == h["host"] == 0 for h in hits[3:]), hits
    s = engine.cache_stats()
    assert s["cache_disk_hit_tokens"] == s["cache_hit_tokens"] and s["cache_disk_bytes_used"] > 0
    flushed = engine.flush_cache()
    assert flushed["flushed_disk_bytes"] == s["cache_disk_bytes_used"] and flushed["flushed_pages"] > 0
    _at_baseline(engine)


def test_reload_from_both_tiers(model, reference, tmp_path):
    # the host tier holds about two sessions: one that comes back soon is still there, one that comes back
    # later has moved on to disk
    engine = _engine(model, pages=16, host_blocks=30, disk=tmp_path, disk_blocks=400)
    hits = _sessions(engine, reference, [0, 1, 2, 0, 3, 4, 1])
    assert hits[3] == {"gpu": 0, "host": 24, "disk": 0} and hits[6] == {"gpu": 0, "host": 0, "disk": 24}
    _at_baseline(engine)


def test_disk_cap_deletes_least_recently_used(model, tmp_path):
    cap = 2 * (STATE_BLOCKS + 7)  # about two sessions' KV and checkpoints
    engine = _engine(model, pages=10, host_blocks=STATE_BLOCKS, disk=tmp_path, disk_blocks=cap)
    sessions = [_ids(24, 70 + s) for s in range(5)]
    for prompt in sessions:
        _generate(engine, prompt, 2)
        disk = engine.cache.tiers.disk
        assert disk.bytes_used <= cap * BLOCK and disk.num_files == len(list(disk.dir.iterdir()))
    assert engine.cache.tiers.num_saved["disk"] + engine.cache.tiers.num_spilled > disk.num_files  # some went
    assert engine.cache.match(sessions[0]).kv_len == 0  # the oldest session left every tier
    assert engine.cache.match(sessions[-2]).kv_len > 0
    _at_baseline(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sessions_on_cuda_match_a_pool_that_never_evicts(tmp_path):
    """The asynchronous path (copy and load streams, events, disk reads): outputs equal those of a GPU pool big
    enough to keep everything, whose resume points are the same."""
    model = build_model("tiny", seed=13, device="cuda")  # fp32: a block is BLOCK bytes
    big = Engine(
        EngineConfig(model="tiny", page_size=PS, max_running_requests=3, checkpoint_interval=0), model=model
    )
    small = _engine(model, pages=16, host_blocks=30, disk=tmp_path, disk_blocks=400)
    hits = _sessions(small, lambda prompt, n: _generate(big, prompt, n), [0, 1, 2, 0, 3, 4, 1, 2])
    assert sum(h["host"] for h in hits) > 0 and sum(h["disk"] for h in hits) > 0
    _at_baseline(small)


# -- scheduling around loads -----------------------------------------------------------------------------------


def test_a_loading_request_waits_and_is_overtaken(model, reference, tmp_path, monkeypatch):
    engine = _engine(model, pages=16, host_blocks=STATE_BLOCKS + 2, disk=tmp_path, disk_blocks=400)
    sessions = [_ids(22, 60 + i) for i in range(5)]
    for prompt in sessions:
        _generate(engine, prompt, 2)
    a, b = sessions[:2]
    assert all(engine.cache.match(p + [1]).resume_node.tier == "disk" for p in (a, b))
    gate = threading.Event()  # disk reads wait for it
    read = hicache._read_blocks
    monkeypatch.setattr(hicache, "_read_blocks", lambda *args: (gate.wait(10), read(*args))[1])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    ra = engine.add_request(a + [1, 2], params)  # a's prefix is on disk
    rfresh = engine.add_request(_ids(9, 63), params)
    out = {ra: [], rfresh: []}

    def step():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.cache.check()

    step()
    assert engine.requests[ra].status is Status.WAITING and engine.requests[rfresh].status is Status.RUNNING
    assert engine.cache.loads and list(engine.scheduler.holds)[0].request_id == ra
    # the pages the load fills are the tree's alone, but not free: they count as in use (the KV usage gauge)
    loading = engine.cache.num_loading_pages
    assert loading == len(a) // engine.kv_pool.page_size > 0
    in_use = engine.stats()["num_pages_in_use"]
    assert in_use == engine.kv_pool.pages_in_use(engine.cache.num_pages) + loading
    assert in_use >= loading + len(engine.requests[rfresh].pages)
    step()  # still reading: the fresh request runs alone
    assert engine.requests[ra].status is Status.WAITING
    gate.set()
    while engine.has_unfinished():
        step()
    assert out[ra] == reference(a + [1, 2], 3) and out[rfresh] == reference(_ids(9, 63), 3)
    assert engine.cache.num_loading_pages == 0 and engine.stats()["num_pages_in_use"] == 0
    assert engine.cache.tier_hit_tokens["disk"] > 0

    # aborted while its prefix is on the way up: the load still lands, then everything is let go
    gate.clear()
    rb = engine.add_request(b + [3], params)
    engine.step()
    assert engine.cache.loads and engine.scheduler.holds
    engine.abort(rb)
    engine.step()
    assert not engine.scheduler.holds and engine.cache.loads  # the load keeps its own lock until it lands
    assert engine.has_unfinished()  # so that a server's engine thread keeps stepping until it does
    gate.set()
    while engine.cache.loads:
        engine.step()
    engine.cache.check()
    _at_baseline(engine)


# -- long random interleaving --------------------------------------------------------------------------------


def test_random_interleaving_with_tiers_returns_to_baseline(model, tmp_path):
    engine = _engine(
        model,
        pages=14,
        host_blocks=2 * STATE_BLOCKS + 6,
        disk=tmp_path,
        disk_blocks=3 * STATE_BLOCKS + 10,
        chunked_prefill_size=12,
        checkpoint_interval=8,
    )
    rng = random.Random(0)
    prefixes = [_ids(16, 90 + i) for i in range(4)]
    live: list[str] = []
    for step in range(70):
        r = rng.random()
        if r < 0.35:
            prompt = rng.choice(prefixes) + _ids(rng.randint(1, 9), step)
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 6))
            live.append(engine.add_request(prompt, params))
        elif r < 0.45 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        elif r < 0.48:
            engine.flush_cache()
        for o in engine.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        engine.cache.check()
    while engine.has_unfinished():
        engine.step()
    assert not engine.scheduler.holds and not engine.cache.loads
    assert engine.cache.tiers.num_loads > 0
    _at_baseline(engine)


# -- configuration -------------------------------------------------------------------------------------------


def test_config_is_validated(model, tmp_path):
    with pytest.raises(KestrelError, match="enable_prefix_cache"):
        EngineConfig(enable_prefix_cache=False, hicache_host_bytes=1 << 20)
    with pytest.raises(KestrelError, match="go together"):
        EngineConfig(hicache_host_bytes=1 << 20, hicache_disk_dir=str(tmp_path))
    with pytest.raises(KestrelError, match="below the host tier"):
        EngineConfig(hicache_disk_dir=str(tmp_path), hicache_disk_bytes=1 << 20)
    with pytest.raises(KestrelError, match=">= 0"):
        EngineConfig(hicache_host_bytes=-1)
    with pytest.raises(KestrelError, match="smaller than one block"):
        _engine(model, pages=8, host_blocks=0.5)
