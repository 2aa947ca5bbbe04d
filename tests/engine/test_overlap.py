"""The overlap schedule: a decode step launched before the one in front of it is read back gives the tokens the
plain schedule gives (every sampling option, stops found a step late, arrivals, aborts in flight), leaves the
prefix cache's checkpoints right, and hands every page and slot back. On CUDA its steady decode step never
waits for the stream."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.generate import generate
from kestrel.models.loader import build_model
from tests.engine.test_engine import _baseline, _prompt, _run

SEED = 7


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=SEED)


def _engine(model, overlap: bool, **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("max_running_requests", 8)
    return Engine(EngineConfig(model="tiny", disable_overlap_schedule=not overlap, **kw), model=model)


def _count_ahead(engine: Engine) -> dict:
    """Wrap the runner so that the decode steps launched ahead (given their tokens on the device) are counted."""
    seen = {"ahead": 0}
    forward = engine.runner.forward

    def counted(batch, decode_ids=None):
        seen["ahead"] += decode_ids is not None
        return forward(batch, decode_ids)

    engine.runner.forward = counted
    return seen


def test_overlap_gives_the_plain_schedules_tokens(model):
    """Greedy, seeded sampling with top-k/top-p, min_tokens with stop token ids, a stop string, different
    lengths and arrivals while steps are in flight: the same tokens and finish reasons with the overlap on as
    off, and most decode steps were launched ahead."""
    free = generate(model, _prompt(12, 5), 24)
    text_engine = _engine(model, True)
    text = text_engine.tokenizer.decode(free)
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].isprintable())
    jobs = {
        "greedy": (_prompt(12, 5), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        "stop_id": (_prompt(12, 5), SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[6]])),
        "min_tokens": (
            _prompt(12, 5),
            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free[2]], min_tokens=5),
        ),
        "stop_str": (_prompt(12, 5), SamplingParams(temperature=0, max_tokens=24, stop=[stop])),
        "sampled": (
            _prompt(17, 1),
            SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=19, seed=11, ignore_eos=True),
        ),
        "short": (_prompt(5, 2), SamplingParams(temperature=1.0, max_tokens=3, seed=3, ignore_eos=True)),
        "late": (_prompt(9, 4), SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)),
    }
    arrivals = {0: ["greedy", "stop_id", "min_tokens", "stop_str", "sampled"], 6: ["short"], 9: ["late"]}
    plain = _engine(model, False)
    want, want_reasons = _run(plain, jobs, arrivals)
    engine = _engine(model, True)
    base = _baseline(engine)
    seen = _count_ahead(engine)
    got, reasons = _run(engine, jobs, arrivals)
    assert got == want and reasons == want_reasons
    assert want["greedy"] == free
    assert reasons["stop_id"] == reasons["stop_str"] == "stop" and len(got["stop_id"]) < 24
    assert len(got["min_tokens"]) >= 5
    assert seen["ahead"] >= 15, seen
    assert engine.in_flight is None and _baseline(engine) == base


def test_penalties_run_ahead_with_the_plain_schedules_tokens(model):
    """Penalties count each request's outputs: the host's lists plus the token of the step in flight, on the device
    only (`pending`). Frequency, presence and repetition penalties, greedy and sampled, beside a request with none:
    they run ahead, with the plain schedule's tokens; the penalties change what is sampled."""
    params = dict(max_tokens=16, ignore_eos=True)
    jobs = {
        "greedy": (_prompt(10, 8), SamplingParams(temperature=0, **params)),
        # a negative penalty: each output is sampled again, so every step counts the token still in flight
        "frequency": (_prompt(10, 8), SamplingParams(temperature=0, frequency_penalty=-2.0, **params)),
        "presence": (_prompt(11, 9), SamplingParams(temperature=0, presence_penalty=1.5, **params)),
        # the token in flight decides this one's 8th token (left uncounted, the 8th differs: checked by hand)
        "presence_in_flight": (
            _prompt(10, 10),
            SamplingParams(temperature=0, presence_penalty=-0.5, **params),
        ),
        "repetition": (_prompt(9, 10), SamplingParams(temperature=0, repetition_penalty=1.8, **params)),
        "sampled": (
            _prompt(8, 11),
            SamplingParams(
                temperature=0.9, top_k=30, seed=4, frequency_penalty=0.7, presence_penalty=0.4, **params
            ),
        ),
    }
    want, _ = _run(_engine(model, False), jobs)
    engine = _engine(model, True)
    seen = _count_ahead(engine)
    got, _ = _run(engine, jobs)
    assert got == want
    assert got["frequency"] != got["greedy"] and len(set(got["frequency"])) < 4  # the same prompt, repeated
    assert seen["ahead"] >= 10, seen


def test_logprobs_run_ahead_with_the_plain_schedules_values(model):
    """Logprobs are computed on the device with the tokens and come up with them: requests that ask for them (top
    2, top 0, one beside a request that asks for none, a sampled one) run ahead, and every token's logprob and
    top alternatives equal the plain schedule's."""
    jobs = {
        "top2": (_prompt(10, 30), SamplingParams(temperature=0, max_tokens=14, logprobs=2, ignore_eos=True)),
        "top0": (_prompt(7, 31), SamplingParams(temperature=0, max_tokens=9, logprobs=0, ignore_eos=True)),
        "none": (_prompt(12, 32), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
        "sampled": (
            _prompt(9, 33),
            SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=5, logprobs=3, ignore_eos=True),
        ),
    }

    def run(engine):
        for rid, (prompt, params) in jobs.items():
            engine.add_request(prompt, params, rid)
        out = {rid: [] for rid in jobs}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += (
                    [(t, None) for t in o.new_token_ids]
                    if o.new_logprobs is None
                    else [(lp.token_id, (lp.logprob, lp.top)) for lp in o.new_logprobs]
                )
        return out

    want = run(_engine(model, False))
    engine = _engine(model, True)
    seen = _count_ahead(engine)
    got = run(engine)
    assert got == want
    assert all(lp is not None for rid in ("top2", "top0", "sampled") for _, lp in got[rid])
    assert all(len(top) == 2 for _, (_, top) in got["top2"]) and all(top == [] for _, (_, top) in got["top0"])
    assert all(lp is None for _, lp in got["none"])
    assert seen["ahead"] >= 10, seen


def test_switching_the_overlap_off_mid_run(model):
    """`engine.overlap = False` (what `bench decode` does for its comparison) lands the step in flight and runs
    the plain schedule from the next step on, with the same tokens."""
    prompt = _prompt(14, 21)
    engine = _engine(model, True)
    seen = _count_ahead(engine)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "a")
    out = []
    for _ in range(6):
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert engine.in_flight is not None and seen["ahead"] > 0
    engine.overlap = False
    before = seen["ahead"]
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
        assert engine.in_flight is None
    assert seen["ahead"] == before
    assert out == generate(model, prompt, 20)


def test_a_slot_freed_by_a_length_finish_admits_as_soon_as_plain(model):
    """Two slots, three requests: when a running request reaches its length limit, the waiting one starts on the
    same step call as under the plain schedule (not a step later), and every output comes on the same call."""
    jobs = {
        "a": (_prompt(9, 70), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
        "c": (_prompt(11, 71), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)),
        "b": (_prompt(6, 72), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
    }
    timelines = []
    for overlap in (False, True):
        engine = _engine(model, overlap, max_running_requests=2)
        for rid, (prompt, params) in jobs.items():
            engine.add_request(prompt, params, rid)
        timeline = []
        while engine.has_unfinished():
            timeline.append(sorted((o.request_id, tuple(o.new_token_ids)) for o in engine.step()))
        timelines.append(timeline)
    assert timelines[0] == timelines[1]


def test_abort_while_in_flight(model):
    """A request aborted while its step is on the device gets one final abort output and nothing after it; the
    others are untouched, and the pools come back whole."""
    engine = _engine(model, True)
    base = _baseline(engine)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["\x00never"])
    prompts = {rid: _prompt(20 + i, 40 + i) for i, rid in enumerate("abc")}
    for rid, p in prompts.items():
        engine.add_request(p, params, rid)
    out = {rid: [] for rid in prompts}
    finished = {}
    while engine.has_unfinished():
        if engine.in_flight is not None and len(out["b"]) == 4 and "b" not in finished:
            assert any(r.request_id == "b" for r in engine.in_flight.batch.decode)
            assert engine.abort("b")
        for o in engine.step():
            assert o.request_id not in finished
            out[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished == {"a": "length", "b": "abort", "c": "length"}
    assert not engine._detok  # each stop-string detokenizer went with its request, the aborted one too
    assert out["b"] == generate(model, prompts["b"], 4)
    for rid in "ac":
        assert out[rid] == generate(model, prompts[rid], 30), rid
    assert _baseline(engine) == base


def test_stops_found_a_step_late_keep_the_cache_right(model):
    """Requests that stop on a sampled token have computed one token more by the time the host sees the stop:
    whatever page alignment that extra step lands on, the prefix cache's pages and decode-time checkpoints
    resume the next turn exactly like an engine with neither the overlap nor the cache."""
    on = _engine(model, True, enable_prefix_cache=True)
    off = _engine(model, False, enable_prefix_cache=False)
    base = _baseline(on)
    for i in range(8):
        prompt = _prompt(9 + i, 60 + i)
        free = generate(model, prompt, 12)
        params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[3 + i % 4]])
        first, _ = _run(on, {"t1": (prompt, params)})
        assert first == _run(off, {"t1": (prompt, params)})[0], i
        history = prompt + first["t1"] + _prompt(3, 90 + i)
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        second, _ = _run(on, {"t2": (history, greedy)})
        assert second == _run(off, {"t2": (history, greedy)})[0], i
    assert on.cache_stats()["cache_hit_tokens"] > 0
    assert on.in_flight is None
    on.flush_cache()
    assert _baseline(on) == base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steady_decode_step_never_waits_for_the_stream():
    """Under the overlap schedule a steady decode step (greedy and seeded sampling, with min_tokens banning a stop
    token id, two requests with logprobs, one with a penalty, one with a logit_bias, one with allowed_token_ids)
    stages, launches and samples without a single stream sync: torch's sync debug mode raises on any."""
    net = build_model("tiny", dtype=torch.bfloat16, device="cuda", seed=SEED)
    engine = Engine(EngineConfig(model="tiny", page_size=4, max_running_requests=8), model=net)
    for i in range(6):
        sampled = i % 2 == 1
        params = SamplingParams(
            temperature=0.8 if sampled else 0,
            max_tokens=40,
            seed=i,
            min_tokens=20,
            ignore_eos=True,
            stop_token_ids=[7],
            logprobs=i if 2 <= i <= 3 else None,
            frequency_penalty=0.5 if i == 3 else 0.0,
            logit_bias={65: 2.0, 66: -3.0} if i == 4 else None,
            allowed_token_ids=list(range(60, 90)) if i == 5 else None,
        )
        engine.add_request(_prompt(30 + i, i), params)
    for _ in range(4):  # prefill, then the first decode steps
        engine.step()
    assert engine.in_flight is not None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished():
        engine.step()
