"""The engine against the reference `generate()`, on the tiny model (every feature on, DSA top-8 so that long
prompts really are sparse): token-for-token equality at temperature 0 across mixed batches, chunked-prefill
boundaries, retraction from a tiny pool and mid-flight arrivals; seeded sampling independent of the batch."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine, RequestError
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.generate import generate
from kestrel.models.loader import build_model

SEED = 7


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=SEED)


def _engine(model, **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_running_requests", 8)
    return Engine(EngineConfig(model="tiny", **kw), model=model)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(
    engine: Engine,
    jobs: dict[str, tuple[list[int], SamplingParams]],
    arrivals: dict[int, list[str]] | None = None,
):
    """Submit jobs (some only at given step numbers), step until done; returns request_id -> tokens."""
    arrivals = arrivals or {0: list(jobs)}
    out = {rid: [] for rid in jobs}
    finished: dict[str, str] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid in arrivals.get(step, []):
            engine.add_request(jobs[rid][0], jobs[rid][1], rid)
        for o in engine.step():
            assert o.request_id not in finished, "an output after the request finished"
            out[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o.finish_reason
        step += 1
        assert step < 10_000
    assert set(finished) == set(jobs)
    return out, finished


def _baseline(engine: Engine) -> tuple[int, int]:
    """Free pages (counting those only the prefix cache holds, which it gives back on demand) and free slots."""
    cached = engine.cache.num_pages if engine.cache is not None else 0
    if engine.cache is not None:
        engine.cache.check()
    return engine.kv_pool.num_free_pages + cached, engine.state_pool.num_free_slots


def _reference(model, prompt, n, **kw):
    return generate(model, prompt, n, **kw)


LENGTHS = [3, 17, 40, 9, 26]


def test_mixed_batch_matches_reference(model):
    engine = _engine(model)
    base = _baseline(engine)
    jobs = {
        f"r{i}": (_prompt(n, i), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for i, n in enumerate(LENGTHS)
    }
    out, reasons = _run(engine, jobs)
    for rid, (prompt, _) in jobs.items():
        assert out[rid] == _reference(model, prompt, 12), rid
        assert reasons[rid] == "length"
    assert _baseline(engine) == base


@pytest.mark.parametrize("budget", [1, 5, 13])
def test_chunked_prefill_boundaries(model, budget):
    engine = _engine(model, chunked_prefill_size=budget)
    jobs = {
        f"r{i}": (_prompt(n, 10 + i), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        for i, n in enumerate([23, 31, 11])
    }
    out, _ = _run(engine, jobs)
    for rid, (prompt, _) in jobs.items():
        assert out[rid] == _reference(model, prompt, 6), rid


def test_retraction_from_a_tiny_pool_keeps_outputs(model):
    # 14 pages of 4 tokens: the requests below need ~50 pages together, so decode growth must preempt.
    engine = _engine(model, kv_cache_bytes=14 * 4 * 448, max_running_requests=6)
    assert engine.kv_pool.num_pages == 14
    base = _baseline(engine)
    jobs = {
        f"r{i}": (_prompt(n, 20 + i), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        for i, n in enumerate([10, 12, 8, 14, 9])
    }
    out, _ = _run(engine, jobs)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to run out"
    for rid, (prompt, _) in jobs.items():
        assert out[rid] == _reference(model, prompt, 20), rid
    assert _baseline(engine) == base


def test_requests_arriving_mid_flight(model):
    engine = _engine(model, chunked_prefill_size=16)
    jobs = {
        f"r{i}": (_prompt(n, 30 + i), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for i, n in enumerate([15, 7, 33, 4])
    }
    out, _ = _run(engine, jobs, arrivals={0: ["r0"], 3: ["r1", "r2"], 7: ["r3"]})
    for rid, (prompt, _) in jobs.items():
        assert out[rid] == _reference(model, prompt, 10), rid


def test_seeded_sampling_alone_equals_in_batch_and_reference(model):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=10, seed=123, ignore_eos=True)
    prompt = _prompt(21, 99)
    alone, _ = _run(_engine(model), {"x": (prompt, params)})
    others = {
        f"o{i}": (_prompt(9 + i, i), SamplingParams(temperature=1.0, max_tokens=15, seed=i, ignore_eos=True))
        for i in range(4)
    }
    crowded, _ = _run(
        _engine(model, chunked_prefill_size=8),
        {"x": (prompt, params), **others},
        arrivals={0: ["o0", "o1"], 1: ["x"], 2: ["o2", "o3"]},
    )
    assert alone["x"] == crowded["x"]
    assert alone["x"] == _reference(model, prompt, 10, temperature=0.9, top_p=0.95, top_k=50, seed=123)
    other_seed, _ = _run(_engine(model), {"x": (prompt, SamplingParams(**{**params.__dict__, "seed": 124}))})
    assert other_seed["x"] != alone["x"]


def test_stop_token_ids_eos_and_stop_strings(model):
    prompt = _prompt(12, 5)
    free = _reference(model, prompt, 16)
    stop_tok = free[5]
    engine = _engine(model)
    out, reason = _run(
        engine, {"a": (prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok]))}
    )
    cut = free.index(stop_tok) + 1
    assert out["a"] == free[:cut] and reason["a"] == "stop"
    # A stop string made of two generated bytes that decode to printable text.
    text = engine.tokenizer.decode(free)
    stop = next(text[i : i + 2] for i in range(len(text) - 1) if text[i : i + 2].isprintable() and i > 2)
    out, reason = _run(engine, {"b": (prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop]))})
    assert reason["b"] == "stop" and stop in engine.tokenizer.decode(out["b"])
    assert out["b"] == free[: len(out["b"])] and len(out["b"]) < 16


def test_a_stop_string_counts_where_it_ends_at_or_past_min_tokens(model):
    """A stop string begun before the min_tokens-th token and ended by it stops the request (the engine decoded
    only from min_tokens on, and never saw its start); one ended before min_tokens does not."""
    prompt = _prompt(12, 5)
    free = _reference(model, prompt, 24)
    engine = _engine(model)

    def first_here(i: int) -> bool:  # tokens i, i + 1 are two printable characters not seen together before
        text = engine.tokenizer.decode(free[: i + 2])
        return all(32 <= t < 127 for t in free[i : i + 2]) and text.find(text[-2:]) == len(text) - 2

    i = next(i for i in range(len(free) - 1) if first_here(i))
    stop = engine.tokenizer.decode(free[i : i + 2])  # ends with token i + 2 (counting from 1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out, reason = _run(engine, {"at": (prompt, dataclasses.replace(params, min_tokens=i + 2))})
    assert out["at"] == free[: i + 2] and reason["at"] == "stop"
    out, _ = _run(engine, {"past": (prompt, dataclasses.replace(params, min_tokens=i + 3))})
    assert out["past"] == free[: len(out["past"])] and len(out["past"]) > i + 2


def test_logprobs_are_the_models(model):
    prompt = _prompt(8, 3)
    engine = _engine(model)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=4))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(lps) == 3
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor(prompt))[-1].float(), -1)
    first = lps[0]
    assert abs(first.logprob - ref[first.token_id].item()) < 1e-4
    assert [t for t, _ in first.top] == ref.topk(4).indices.tolist()
    assert first.token_id == first.top[0][0]  # greedy picks the top token


def test_penalties_change_the_output(model):
    prompt = _prompt(10, 8)
    plain, _ = _run(
        _engine(model), {"a": (prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))}
    )
    rep, _ = _run(
        _engine(model),
        {
            "a": (
                prompt,
                SamplingParams(
                    temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.5
                ),
            )
        },
    )
    assert plain["a"] != rep["a"]
    counts = torch.bincount(torch.tensor(rep["a"]))
    assert counts.max() <= torch.bincount(torch.tensor(plain["a"])).max()


def test_abort_frees_resources(model):
    engine = _engine(model)
    base = _baseline(engine)
    engine.add_request(_prompt(30, 1), SamplingParams(temperature=0, max_tokens=50), "a")
    engine.add_request(_prompt(30, 2), SamplingParams(temperature=0, max_tokens=50), "b")
    engine.step()
    assert engine.abort("a") and engine.abort("b") and not engine.abort("zzz")
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished and o.finish_reason == "abort"} == {"a", "b"}
    assert not engine.has_unfinished() and _baseline(engine) == base


def test_bad_requests_are_refused(model):
    engine = _engine(model, max_model_len=64)
    with pytest.raises(RequestError, match="context limit"):
        engine.add_request(_prompt(70, 1), SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request(_prompt(40, 1), SamplingParams(max_tokens=30))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    # the first bad id is named (as vLLM's "Token id X is out of vocabulary")
    for bad in ([1, 2, 9999], [1, -1], [1, True], [1, 2.0], [1, "2"], [1, None]):
        with pytest.raises(
            RequestError, match=f"prompt token id {re.escape(repr(bad[-1]))} is (outside|not)"
        ):
            engine.add_request(bad, SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not engine.has_unfinished()


def test_graph_inputs_from_the_slot_page_table(model, monkeypatch):
    """The decode graphs' inputs come from a device page table kept per state slot, sent only the pages each
    request gained since its last step (all of them for a new request in the slot), gathered by the graph's
    first kernels (`_page_inputs`): they equal the inputs built from the request lists, and the step computes
    the same logits although the columns past a row's pages hold stale page ids (another request's), which no
    kernel reads."""
    engine = _engine(model, page_size=4, max_running_requests=3)
    runner, size = engine.runner, 4
    ids, pos, slots, table, lens, rows = runner._decode_inputs([], runner.max_pages, size)
    runner.static_tokens = torch.stack([ids, pos, slots])
    runner.static = [*runner.static_tokens, table, lens, rows]
    runner.slot_pages = torch.randint(
        1, engine.kv_pool.num_pages, (engine.state_pool.num_slots + 1, runner.max_pages)
    )
    runner.slot_pages[0] = 0  # the dummy slot of the padding rows
    pools = [t for d in (engine.state_pool.ssm, engine.state_pool.conv) for t in d.values()]
    seen = {"steps": 0, "compared": 0}
    eager = runner._decode

    def decode(
        reqs, ids=None
    ):  # inside Engine.step, after the scheduler gave each request its page for this token
        runner._stage(reqs, ids)
        runner._page_inputs(*[t[:size] for t in runner.static])  # the graph's first kernels
        fresh = runner._decode_inputs(reqs, runner.max_pages, size)
        if ids is not None:  # a step launched ahead: its tokens come from the step before it, on the device
            fresh[0][: len(reqs)] = ids
        for k in (0, 1, 2, 4, 5):  # ids, positions, slots, lengths, write rows
            assert torch.equal(runner.static[k][:size], fresh[k])
        for j, r in enumerate(reqs):
            assert runner.static[3][j, : len(r.pages)].tolist() == r.pages
        seen["steps"] += 1
        if seen["compared"] == 0:
            saved = [t.clone() for t in pools]
            staged = runner._decode_forward(*[t[:size] for t in runner.static])[: len(reqs)]
            for t, s in zip(pools, saved):  # the step advanced the KDA states in place: back to before it
                t.copy_(s)
            full = runner._decode_forward(*fresh)[: len(reqs)]
            for t, s in zip(pools, saved):
                t.copy_(s)
            torch.testing.assert_close(staged, full, rtol=0, atol=0)
            seen["compared"] += 1
        return eager(reqs, ids)

    monkeypatch.setattr(runner, "_decode", decode)
    for i, n in enumerate((5, 23, 37)):
        engine.add_request(_prompt(n, i), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    added = 0
    while engine.has_unfinished():
        engine.step()
        if len(engine.scheduler.running) < 3 and not engine.scheduler.waiting and added < 3:
            # a new request takes a freed slot: its pages are sent whole
            engine.add_request(
                _prompt(11, 10 + added), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            )
            added += 1
    assert seen["steps"] >= 10 and added == 3
