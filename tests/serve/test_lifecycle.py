"""Requests end cleanly whatever the client does: a client that disconnects (mid-stream, or while waiting for a
non-streamed answer) has its request aborted and its KV pages and state slot freed; 200 concurrent streams all
complete; a failing engine ends open streams with an error event and turns /health to 503."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, metric_samples

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def test_disconnect_mid_stream_frees_pages_and_slot(server):
    base = server.pools()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "stream": True, **LONG}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(12)) if line.startswith("data: ")]
        assert len(data) >= 4
        assert server.pools()[2] == 1  # running
    server.wait_for_pools(base)
    # the same with n=2 on /v1/completions and on /generate
    body = {"model": MODEL, "prompt": "go on", "stream": True, "n": 2, **LONG}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        next(r.iter_lines())
    server.wait_for_pools(base)
    body = {"text": "go", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=30) as r:
        next(r.iter_lines())
    server.wait_for_pools(base)
    metrics = metric_samples(httpx.get(f"{server.url}/metrics").text)
    assert metrics['kestrel_requests_total{finish_reason="abort"}'] >= 4  # 1 + 2 + 1 requests


def test_disconnect_while_waiting_for_a_whole_answer_frees_pages_and_slot(server):
    base = server.pools()
    body = {"model": MODEL, "prompt": "patience", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    server.wait_for_pools(base)


def test_200_concurrent_streams_all_complete(server):
    base = server.pools()
    num = 200

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None, int]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=3 + i % 4,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, reason, tokens = "", None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return i, text, reason, tokens

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num)))

    results = asyncio.run(main())
    assert sorted(i for i, *_ in results) == list(range(num))
    for i, _, reason, tokens in results:
        assert reason == "length" and tokens == 3 + i % 4, (i, reason, tokens)
    server.wait_for_pools(base)
    metrics = metric_samples(httpx.get(f"{server.url}/metrics").text)
    assert metrics['kestrel_requests_total{finish_reason="length"}'] >= num


def test_engine_failure_ends_streams_and_fails_health(make_server):
    s = make_server(max_running_requests=4)
    real_step, fail = s.engine.step, threading.Event()

    def failing_step():
        if fail.is_set():
            raise RuntimeError("simulated device error")
        return real_step()

    s.engine.step = failing_step
    body = {"model": MODEL, "prompt": "doomed", **LONG}
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=30)
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            while s.pools()[2] < 2:  # both running
                time.sleep(0.01)
            fail.set()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "simulated device error" in error["message"] and error["code"] == "engine_unavailable"
        r = whole.result()
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    health = httpx.get(f"{s.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    # the openai client sees the failure as an error, not as a silently short answer
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=2)


def test_a_request_aborted_before_its_first_output_counts_its_queue_time(make_server):
    """A client that leaves after its request was admitted but before any output reached the server: the
    request's last outputs come to a closed group, whose late-output hook still observes its queue time (the
    histogram missed it before)."""
    srv = make_server()
    step, gate, held = srv.engine.step, threading.Event(), threading.Event()

    def gated_step():
        outs = step()
        if outs and not gate.is_set():  # the first token, held in the engine thread until the client has gone
            held.set()
            gate.wait(20)
        return outs

    srv.engine.step = gated_step
    count = lambda: metric_samples(httpx.get(f"{srv.url}/metrics").text).get(  # noqa: E731
        "kestrel_request_queue_time_seconds_count", 0
    )
    before = count()
    body = {"model": MODEL, "prompt": "leave early", **LONG}
    with ThreadPoolExecutor(1) as pool:
        gone = pool.submit(httpx.post, f"{srv.url}/v1/completions", json=body, timeout=1.0)
        assert held.wait(20)
        with pytest.raises(httpx.ReadTimeout):
            gone.result()
    deadline = time.monotonic() + 10
    while not srv.async_engine._commands:  # the server has seen the disconnect and asked for the abort
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert count() == before
    gate.set()
    deadline = time.monotonic() + 10
    while count() != before + 1:
        assert time.monotonic() < deadline, "the aborted request's queue time was not observed"
        time.sleep(0.05)


def test_a_responses_stream_ends_failed_when_the_engine_fails(make_server):
    """The Responses API's stream has no [DONE]: an engine failure ends it with an `error` event and the response
    `failed` (its terminal event, which clients wait for), never a cut connection."""
    s = make_server()

    def failing_step():
        raise RuntimeError("simulated device error")

    s.engine.step = failing_step
    body = {"model": MODEL, "input": "doomed", "stream": True}
    with httpx.stream("POST", f"{s.url}/v1/responses", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"], kinds
    assert events[-2]["code"] == "engine_unavailable" and "simulated device error" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_unavailable"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
