"""AsyncEngine: the engine in its own thread behind asyncio. Same tokens as the engine driven directly; request
errors and overload raised in the caller; aborts (a consumer that stops early) free pages and slots; a failed
step fails every open stream and marks the engine unhealthy; an idle engine thread does not step."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from kestrel.config import EngineConfig
from kestrel.engine.async_engine import AsyncEngine, EngineDead, Overloaded
from kestrel.engine.engine import Engine, RequestError
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def _engine(model, **kw) -> Engine:
    kw.setdefault("page_size", 8)
    kw.setdefault("max_running_requests", 4)
    return Engine(EngineConfig(model="tiny", **kw), model=model)


@contextlib.contextmanager
def running(engine: Engine, **kw):
    ae = AsyncEngine(engine, **kw)
    try:
        yield ae
    finally:
        ae.shutdown()


def _pools(stats: dict) -> tuple[int, int, int]:
    return (
        stats["num_free_pages"] + stats.get("num_cached_pages", 0),
        stats["num_free_slots"],
        stats["num_running"],
    )


async def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_same_tokens_as_the_engine_driven_directly(model):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(30, 50))]
    direct = _engine(model)
    for i, p in enumerate(prompts):
        direct.add_request(p, GREEDY, str(i))
    want = {str(i): [] for i in range(len(prompts))}
    while direct.has_unfinished():
        for out in direct.step():
            want[out.request_id] += out.new_token_ids

    async def main(ae):
        async def one(i, p):
            outs = [o async for o in ae.generate(p, GREEDY, str(i))]
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            return [t for o in outs for t in o.new_token_ids]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    with running(_engine(model)) as ae:
        got = asyncio.run(main(ae))
    assert got == [want[str(i)] for i in range(len(prompts))]


def test_request_errors_are_raised_in_the_caller(model):
    async def main(ae):
        with pytest.raises(RequestError, match="context limit") as e:
            ae.submit([(list(range(40)), GREEDY)])
        assert e.value.code == "context_length_exceeded"
        with pytest.raises(RequestError, match="max_tokens"):
            ae.submit([(list(range(10)), SamplingParams(max_tokens=30))])
        with pytest.raises(RequestError, match="empty"):
            ae.submit([([], GREEDY)])
        # all or nothing: one bad member queues none
        with pytest.raises(RequestError):
            ae.submit([([1, 2], GREEDY), ([1, 9999], GREEDY)])
        assert ae.stats()["num_queued"] == 0

    with running(_engine(model, max_model_len=32)) as ae:
        asyncio.run(main(ae))


def test_overload_is_refused_before_queueing(model):
    engine = _engine(model, max_running_requests=1)
    gate = threading.Event()
    real_step = engine.step

    def held_step():
        gate.wait()
        return real_step()

    engine.step = held_step

    async def main(ae):
        # before any step: the first takes the free slot, the second the one place in the queue
        first = ae.submit([([1, 2, 3], GREEDY)])
        second = ae.submit([([4, 5, 6], GREEDY)])
        with pytest.raises(Overloaded, match="overloaded: 1 requests are waiting"):
            ae.submit([([7, 8, 9], GREEDY)])
        gate.set()
        for group in (first, second):
            assert [o async for _, o in group][-1].finish_reason == "length"
        third = ae.submit([([7, 8, 9], GREEDY)])  # room again
        assert [o async for _, o in third][-1].finish_reason == "length"
        # a group as large as the slots and the queue together is taken (one slot and one place here): the
        # limit had been the queue's alone, refusing groups that an idle engine runs; one larger is a 400
        # naming n (one prompt's samples share its list) or prompt
        pair = ae.submit([([1, 2], GREEDY)] * 2)
        assert [o.finish_reason async for _, o in pair if o.finished] == ["length"] * 2
        prompt = [1, 2]
        with pytest.raises(RequestError, match=r"needs 3 sequences .* \(1 \+ 1\)") as e:
            ae.submit([(prompt, GREEDY)] * 3)
        assert e.value.param == "n"
        with pytest.raises(RequestError) as e:
            ae.submit([([1], GREEDY), ([2], GREEDY), ([3], GREEDY)])
        assert e.value.param == "prompt"

    with running(engine, max_queued=1) as ae:
        asyncio.run(main(ae))


def test_a_consumer_that_stops_early_frees_its_pages_and_slot(model):
    async def main(ae):
        base = _pools(ae.stats())
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        async with contextlib.aclosing(ae.generate(list(range(20)), long, "x")) as stream:
            async for out in stream:
                if out.num_output_tokens >= 3:
                    break
        group = ae.submit([([1, 2, 3], long), ([4, 5], long)], "g")
        await anext(group)
        group.close()
        ae.abort("nobody")  # unknown ids are ignored
        await _wait_for(lambda: _pools(ae.stats()) == base)

    with running(_engine(model)) as ae:
        asyncio.run(main(ae))


def test_abort_by_group_id_ends_every_member(model):
    async def main(ae):
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        group = ae.submit([([1, 2, 3], long), ([4, 5], long)], "grp")
        ae.abort("grp")
        reasons = {o.request_id: o.finish_reason async for _, o in group if o.finished}
        assert reasons == {"grp-0": "abort", "grp-1": "abort"}

    with running(_engine(model)) as ae:
        asyncio.run(main(ae))


def test_a_failing_step_fails_open_streams_and_marks_unhealthy(model):
    engine = _engine(model)
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("simulated device error")
        return real_step()

    engine.step = failing_step

    async def main(ae):
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        with pytest.raises(EngineDead, match="simulated device error"):
            async for _ in ae.generate([1, 2, 3], params):
                pass
        assert not ae.healthy
        with pytest.raises(EngineDead):
            ae.submit([([1, 2], params)])

    with running(engine) as ae:
        asyncio.run(main(ae))


def test_idle_engine_thread_does_not_step(model):
    engine = _engine(model)
    real_step, calls = engine.step, []
    engine.step = lambda: calls.append(1) or real_step()

    async def main(ae):
        [o async for o in ae.generate([1, 2, 3], GREEDY)]
        busy = len(calls)
        await asyncio.sleep(0.3)
        assert len(calls) == busy

    with running(engine) as ae:
        asyncio.run(main(ae))


def test_shutdown_fails_open_streams(model):
    async def main(ae):
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        group = ae.submit([([1, 2, 3], params)])
        await anext(group)
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineDead, match="shutting down"):
            async for _ in group:
                pass
        assert not ae.healthy
        with pytest.raises(EngineDead):
            ae.submit([([1, 2], params)])

    ae = AsyncEngine(_engine(model))
    asyncio.run(main(ae))


def test_a_closed_group_hands_late_outputs_to_its_hook_and_survives_its_failure(caplog):
    """After close(), outputs (queued unread, or still to come) go to `on_late` with their member's index; a hook
    that raises is logged, not raised into the loop's delivery of the other groups' outputs."""
    from kestrel.engine.async_engine import RequestGroup
    from kestrel.engine.outputs import StepOutput

    class Owner:
        aborted: list[str] = []

        def abort(self, rid):
            self.aborted.append(rid)

    def out(rid, finished=False):
        return StepOutput(rid, [], None, finished, "abort" if finished else None, None, 3, 0, queue_time=0.5)

    async def main():
        group = RequestGroup(Owner(), ["g-0", "g-1"], asyncio.get_running_loop())
        seen = []
        group.on_late = lambda index, o: seen.append((index, o.queue_time))
        group._put(out("g-1"))  # come, not read
        group.close()
        group._put(out("g-0", finished=True))
        assert seen == [(1, 0.5), (0, 0.5)] and sorted(group._owner.aborted) == ["g-0", "g-1"]
        group.on_late = lambda index, o: 1 / 0
        with caplog.at_level("ERROR", logger="kestrel.engine"):
            group._put(out("g-1", finished=True))
        assert "late-output hook failed" in caplog.text

    asyncio.run(main())
