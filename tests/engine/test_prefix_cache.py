"""The hybrid prefix cache: tree operations, checkpoint placement, and outputs identical with the cache on and
off (temperature 0, tiny model) for shared prefixes, multi-turn continuations, eviction under pressure and
sessions that diverge mid-page; a long random interleaving ends with the pools at baseline."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from kestrel.cache.kv_pool import KVPool
from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import StatePool
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model
from kestrel.presets import preset_config

PS = 4


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=13)


def _engine(model, cache: bool, **kw) -> Engine:
    kw.setdefault("page_size", PS)
    kw.setdefault("max_running_requests", 6)
    kw.setdefault("checkpoint_interval", 16)
    return Engine(EngineConfig(model="tiny", enable_prefix_cache=cache, **kw), model=model)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(engine: Engine, prompt: list[int], n: int = 8, rid: str | None = None) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), rid)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


def _idle_pools(engine: Engine) -> tuple[int, int]:
    engine.cache.check()
    held = sum(
        n.checkpoint is not None for n in engine.cache._nodes()
    )  # idle: only the tree holds checkpoints
    assert engine.checkpoint_pool.num_free_slots + held == engine.checkpoint_pool.num_slots
    return engine.kv_pool.num_free_pages + engine.cache.num_pages, engine.state_pool.num_free_slots


# -- the tree alone -------------------------------------------------------------------------------------------


@pytest.fixture
def tree():
    config = preset_config("tiny")
    kv = KVPool(config, 40, PS, torch.float32, "cpu")
    ckpt = StatePool(config, 6, torch.float32, "cpu", zero_on_alloc=False)
    return RadixCache(kv, ckpt, PS), kv, ckpt


def test_insert_match_split_and_refcounts(tree):
    cache, kv, ckpt = tree
    a = list(range(100, 116))  # 4 pages
    pages = kv.alloc(4)
    node = cache.insert(a, pages)
    assert node.depth == 16 and cache.num_pages == 4 and all(kv.refcount[p] == 2 for p in pages)
    assert cache.attach_checkpoint(node, ckpt.alloc())
    # same first 2 pages, then different: the match splits the edge at the page boundary
    b = a[:8] + [7, 7, 7, 7, 9]
    m = cache.match(b)
    assert m.kv_len == 8 and m.resume_len == 0  # no checkpoint at 8 yet
    assert len(cache.root.children) == 1 and next(iter(cache.root.children.values())).depth == 8
    m = cache.match(a + [1])
    assert m.resume_len == 16 and m.resume_node is node and m.pages(16) == pages
    assert cache.match(a).resume_len == 0  # a resume point must leave one token to compute
    cache.check()
    kv.free(pages)  # the request lets go; the tree keeps its own reference
    assert all(kv.refcount[p] == 1 for p in pages)


def test_eviction_is_lru_and_respects_locks_and_pins(tree):
    cache, kv, ckpt = tree
    nodes = []
    for i in range(3):
        toks = [i] * 8
        pages = kv.alloc(2)
        node = cache.insert(toks, pages)
        kv.free(pages)
        cache.attach_checkpoint(node, ckpt.alloc())
        nodes.append(node)
    cache.match([1] * 8 + [0])  # touch node 1
    cache.lock(nodes[0])
    cache.pin(nodes[0])  # a request admitted on it, about to restore its checkpoint
    free = kv.num_free_pages
    assert cache.evict_pages(2) == 2  # node 2: the least recent unlocked leaf (node 0 is locked)
    assert [0] * 4 in [list(n.tokens[:4]) for n in cache.root.children.values()]
    assert kv.num_free_pages == free + 2 and ckpt.num_free_slots == 4
    assert cache.evict_checkpoints(5) == 1  # only node 1's: node 0's is pinned
    cache.check()
    cache.unpin(nodes[0])  # restored: the request's state is in its own slot now
    assert cache.evict_checkpoints(5) == 1  # a lock keeps the path's KV, not its checkpoint
    assert nodes[0].pages and nodes[0].checkpoint is None
    cache.unlock(nodes[0])
    cache.flush()
    assert cache.num_pages == 0 and kv.num_free_pages == 40 and ckpt.num_free_slots == 6
    cache.check()


def _cached_with_checkpoint(cache, kv, ckpt, tokens):
    """Insert `tokens` (whole pages) into the tree, as a finished request would, with a checkpoint at the end."""
    pages = kv.alloc(len(tokens) // PS)
    node = cache.insert(tokens, pages)
    kv.free(pages)
    assert cache.attach_checkpoint(node, ckpt.alloc())
    return node


def test_superseded_checkpoints_are_evicted_first(tree):
    """A conversation's earlier checkpoint goes before another conversation's last one, even a less recent one."""
    cache, kv, ckpt = tree

    add = functools.partial(_cached_with_checkpoint, cache, kv, ckpt)

    other = add([9] * 8)  # the least recent
    turn1 = add([1] * 8)
    turn2 = add([1] * 8 + [2] * 8)  # the same conversation, grown past turn1
    cache.match([1] * 16 + [3])  # touch the conversation
    assert cache.evict_checkpoints(1) == 1
    assert turn1.checkpoint is None and other.checkpoint is not None and turn2.checkpoint is not None
    assert cache.evict_checkpoints(1) == 1  # then least recently used: the other conversation's
    assert other.checkpoint is None and turn2.checkpoint is not None
    cache.check()


def test_branch_point_checkpoints_are_not_superseded(tree):
    """A checkpoint where conversations branch (a shared system prompt) serves every new branch: it goes by
    LRU like a leaf, not first."""
    cache, kv, ckpt = tree

    add = functools.partial(_cached_with_checkpoint, cache, kv, ckpt)

    old = add([9] * 8)  # the least recent
    system = add([1] * 8)
    a, b = add([1] * 8 + [2] * 4), add([1] * 8 + [3] * 4)  # two sessions off the shared prompt
    cache.match([1] * 8 + [2] * 4 + [5])
    cache.match([1] * 8 + [3] * 4 + [5])
    assert cache.evict_checkpoints(1) == 1
    assert old.checkpoint is None and system.checkpoint is not None
    assert a.checkpoint is not None and b.checkpoint is not None


# -- checkpoint placement ----------------------------------------------------------------------------------------


def test_checkpoints_at_intervals_prompt_end_and_completion_end(model):
    engine = _engine(model, True, checkpoint_interval=16)
    prompt = _ids(45, 1)  # checkpoints at 16, 32 (interval) and 44 (last page boundary before token 45)
    _generate(engine, prompt, 10)  # 45 + 10 = 55 tokens; 54 computed -> decode checkpoint at 52
    depths = sorted(n.depth for n in engine.cache._nodes() if n.checkpoint is not None)
    assert depths == [16, 32, 44, 52]


def test_branch_and_prompt_end_checkpoints_do_not_cut_the_chunk(model, monkeypatch):
    """The prompt-end and branch checkpoints are saved inside their chunk (the KDA layers compute those states
    in the same forward); requests resuming from them compute what the cache-off engine computes. Interval
    checkpoints are where chunks end."""
    engine, off = _engine(model, True, checkpoint_interval=32), _engine(model, False)
    forwards = []
    prefill = engine.runner._prefill
    monkeypatch.setattr(
        engine.runner, "_prefill", lambda chunks: forwards.append(chunks[0].end) or prefill(chunks)
    )
    prompt = _ids(45, 3)
    _generate(engine, prompt, 2)
    assert forwards == [32, 45]  # cut at the interval checkpoint 32; the prompt-end one (44) saved inside
    assert engine.cache.match(prompt[:44] + [7]).resume_len == 44
    turn = prompt[:44] + _ids(20, 4)
    assert _generate(engine, turn, 8) == _generate(off, turn, 8)
    forwards.clear()
    branch = prompt[:22] + _ids(8, 5)  # leaves the tree at 20: a branch checkpoint there, inside its chunk
    assert _generate(engine, branch, 4) == _generate(off, branch, 4)
    assert forwards == [30]
    other = prompt[:22] + _ids(8, 6)
    assert engine.cache.match(other).resume_len == 20
    assert _generate(engine, other, 8) == _generate(off, other, 8)


# -- identity: cache on == cache off -----------------------------------------------------------------------------


def test_shared_prefix_identity_and_hits(model):
    on, off = _engine(model, True), _engine(model, False)
    system = _ids(37, 2)
    for i in range(4):
        prompt = system + _ids(5 + 3 * i, 10 + i)
        assert _generate(on, prompt) == _generate(off, prompt), i
    stats = on.cache_stats()
    # request 1 resumes at the interval checkpoint (32) and saves one at its branch point (36, the shared
    # prefix rounded down to a page); requests 2 and 3 resume there
    assert stats["cache_hit_tokens"] == 32 + 36 + 36
    assert _idle_pools(on)[1] == on.state_pool.num_slots


@pytest.mark.parametrize("index_key_dtype", ["auto", "fp8"])
def test_multi_turn_continuation_identity(model, index_key_dtype):
    on = _engine(model, True, index_key_dtype=index_key_dtype)
    off = _engine(model, False, index_key_dtype=index_key_dtype)
    history = _ids(30, 3)
    for turn in range(4):
        out_on, out_off = _generate(on, history, 9), _generate(off, history, 9)
        assert out_on == out_off, turn
        history = history + out_on + _ids(6, 100 + turn)  # the reply, then the next user message
    assert on.cache_stats()["cache_hit_tokens"] > 0


def test_sessions_diverging_mid_page(model):
    on, off = _engine(model, True), _engine(model, False)
    base = _ids(26, 4)  # diverge at token 26, inside page 6 (tokens 24..27)
    a, b = base + _ids(9, 5), base + _ids(11, 6)
    for prompt in (a, b, a + [3, 4], b[:-1]):
        assert _generate(on, prompt) == _generate(off, prompt)
    depths = {n.depth for n in on.cache._nodes() if n.checkpoint is not None}
    assert 24 in depths  # the branch point, page-aligned, got its own checkpoint


def test_eviction_under_pressure_identity(model):
    # 30 pages of 4 tokens and 4 checkpoint slots: sessions of ~50 tokens keep evicting each other
    on = _engine(model, True, kv_cache_bytes=30 * PS * 448, num_checkpoints=4, max_running_requests=3)
    off = _engine(model, False, max_running_requests=3)
    sessions = [_ids(30 + 3 * s, 20 + s) for s in range(4)]
    for round_ in range(3):
        for s, prompt in enumerate(sessions):
            out_on, out_off = _generate(on, prompt, 6), _generate(off, prompt, 6)
            assert out_on == out_off, (round_, s)
            sessions[s] = prompt + out_on + [s, round_]
    assert on.cache.num_pages <= 30
    assert _idle_pools(on) == (on.kv_pool.num_pages, on.state_pool.num_slots)


def test_random_interleaving_returns_to_baseline(model):
    engine = _engine(
        model,
        True,
        kv_cache_bytes=40 * PS * 448,
        num_checkpoints=5,
        max_running_requests=4,
        chunked_prefill_size=12,
    )
    rng = random.Random(0)
    prefixes = [_ids(20, 40 + i) for i in range(3)]
    live: list[str] = []
    for step in range(150):
        r = rng.random()
        if r < 0.35:
            prompt = rng.choice(prefixes) + _ids(rng.randint(1, 9), step)
            live.append(
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 12)))
            )
        elif r < 0.45 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        elif r < 0.5:
            engine.flush_cache()
        for o in engine.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        engine.cache.check()
    while engine.has_unfinished():
        engine.step()
    assert _idle_pools(engine) == (engine.kv_pool.num_pages, engine.state_pool.num_slots)
    engine.flush_cache()
    assert engine.kv_pool.num_free_pages == engine.kv_pool.num_pages
    assert engine.checkpoint_pool.num_free_slots == engine.checkpoint_pool.num_slots


def test_token_rows_follow_the_page_table():
    config = preset_config("tiny")
    kv = KVPool(config, 10, 4, torch.float32, "cpu")
    table = [7, 3, 9, 1]
    for start, end in [(0, 16), (1, 15), (5, 6), (4, 8), (3, 3), (13, 16)]:
        want = [table[p // 4] * 4 + p % 4 for p in range(start, end)]
        assert kv.token_rows(table, start, end).tolist() == want


def test_every_checkpoint_resumes_like_the_cache_off_engine(model):
    """Requests branching off a cached prompt at random points, prefilled together in small chunks (so saves
    fall inside chunks that start mid-prompt, several sequences a step): each checkpoint the tree then holds,
    resumed with a fresh continuation, computes what the cache-off engine computes."""
    off = _engine(model, False)
    rng = random.Random(0)
    engine = _engine(model, True, checkpoint_interval=0, chunked_prefill_size=50, num_checkpoints=64)
    base = _ids(70, 100)
    _generate(engine, base, 2)
    for i in range(4):
        prompt = base[: rng.randrange(10, 60)] + _ids(rng.randrange(20, 50), 200 + i)
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    held = [n for n in engine.cache._nodes() if n.checkpoint is not None]
    assert len(held) >= 8
    for node in held:
        tokens, up = [], node
        while up is not engine.cache.root:
            tokens, up = list(up.tokens) + tokens, up.parent
        turn = tokens + _ids(7, node.depth)
        assert engine.cache.match(turn).resume_len == node.depth
        assert _generate(engine, turn, 3) == _generate(off, turn, 3), node.depth


def test_warm_up_hits_the_cache_then_leaves_the_engine_as_new(model):
    """The server's warm-up runs a long prefill, a cache hit and decode, then flushes the cache and resets its
    counters: the stats, and what the next request generates, are those of a fresh engine."""
    warm, fresh = _engine(model, True), _engine(model, True)
    hits_before_reset = []
    reset = warm.cache.reset_stats
    warm.cache.reset_stats = lambda: (hits_before_reset.append(warm.cache.hit_tokens), reset())[1]
    assert warm.warm_up(prompt_tokens=48) > 0
    assert hits_before_reset and hits_before_reset[0] >= 48 - PS  # the second turn resumed from the first
    assert warm.stats() == fresh.stats()
    prompt = _ids(40, seed=5)
    assert _generate(warm, prompt) == _generate(fresh, prompt)
    warm.add_request(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(Exception, match="idle engine"):
        warm.warm_up()


def test_multi_turn_reuse_with_two_checkpoints_per_session(model):
    """16 sessions of 3 turns, all running at once, with 2 checkpoint slots each (decode's tracking slots come
    from the same pool). A lock keeps a running path's KV but not its checkpoints: the earlier, superseded ones
    on that path make room for the turn's own, so the next turns resume almost everything (98%; 94% when locks
    kept checkpoints too). The answers equal the cache-off engine's, and the pools end at baseline."""
    n, turns = 16, 3
    on = _engine(
        model, True, page_size=16, max_running_requests=n, num_checkpoints=2 * n, checkpoint_interval=256
    )
    off = _engine(model, False, page_size=16, max_running_requests=n)
    rng = random.Random(0)
    prompts = [_ids(300 + rng.randrange(64), seed=s) for s in range(n)]
    reusable = hits = 0
    baseline = _idle_pools(on)
    for turn in range(turns):
        before = on.cache.hit_tokens
        params = [
            SamplingParams(temperature=0, max_tokens=rng.randrange(10, 40), ignore_eos=True) for _ in range(n)
        ]
        answers = []
        for engine in (on, off):
            rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
            outs = {r: [] for r in rids}
            while engine.has_unfinished():
                for o in engine.step():
                    outs[o.request_id] += o.new_token_ids
            answers.append([outs[r] for r in rids])
        assert answers[0] == answers[1]
        if turn:
            hits += on.cache.hit_tokens - before
        if turn + 1 < turns:
            reusable += sum(len(p) + len(a) for p, a in zip(prompts, answers[0]))
        prompts = [
            p + a + _ids(20 + rng.randrange(80), seed=100 * turn + s)
            for s, (p, a) in enumerate(zip(prompts, answers[0]))
        ]
    assert hits / reusable >= 0.95
    on.flush_cache()
    assert _idle_pools(on) == baseline


def test_the_samples_of_one_prompt_prefill_it_once(model):
    """n samples of a prompt (and the same prompt sent again while the first is prefilling) wait for the first
    one's prompt-end checkpoint and resume from it: the prompt is computed once, not n times (each had prefilled
    it whole), with the cache-off engine's tokens."""
    on, off = _engine(model, True, chunked_prefill_size=16), _engine(model, False, chunked_prefill_size=16)
    prompt = _ids(61, 7)
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=6, ignore_eos=True, n=3)

    def run(engine):
        rids = [engine.add_request(prompt, child, f"s{j}") for j, child in enumerate(params.children())]
        rids.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6), "again"))
        other = engine.add_request(_ids(30, 8), SamplingParams(temperature=0, max_tokens=6), "other")
        outs = {r: [] for r in [*rids, other]}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] += o.new_token_ids
        return outs

    got, want = run(on), run(off)
    assert got == want
    stats = on.cache_stats()
    # the three followers resume at the first one's prompt-end checkpoint (60: the last page boundary before the
    # prompt's last token); "other" shares nothing
    assert stats["cache_hit_tokens"] == 3 * 60, stats
    assert _idle_pools(on)[1] == on.state_pool.num_slots


def test_waiting_samples_keep_their_slots(model):
    """While the samples of a prompt wait for its first sample's prefill, the requests behind them may start,
    but not in the slots the samples need: they had taken them, and the samples then ran one after another as
    those requests finished (first tokens at steps 4 / 54 / 104 / 154 with 4 slots, in a review's run)."""
    engine = _engine(model, True, max_running_requests=4, chunked_prefill_size=16)
    prompt = _ids(40, 3)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True, n=4)
    samples = [engine.add_request(prompt, child, f"s{j}") for j, child in enumerate(params.children())]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for k in range(3):
        engine.add_request(_ids(20, 30 + k), long, f"long{k}")
    first, step = {}, 0
    while engine.has_unfinished():
        step += 1
        for o in engine.step():
            if o.new_token_ids:
                first.setdefault(o.request_id, step)
    assert max(first[s] for s in samples) - min(first[s] for s in samples) <= 2, first
    assert (
        engine.cache_stats()["cache_hit_tokens"] >= 3 * 36
    )  # the three later samples resumed from the cache
