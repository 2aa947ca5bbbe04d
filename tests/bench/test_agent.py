"""`kestrel bench agent`: a short sweep against a real Kestrel server on the tiny preset (every request done,
the history growing turn by turn, prefix-cache hits, the JSON and the PNG), a fake engine without Kestrel's
extensions, the statistics as pure functions, and bad input as one-line errors."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from kestrel.bench.agent import (
    AgentBenchConfig,
    SessionPlan,
    Spread,
    TextSizer,
    TextSource,
    cache_deltas,
    format_table,
    latency_stats,
    percentile,
    run_sweep,
    speed_stats,
    summarize_level,
)
from kestrel.tokenizer import ByteTokenizer
from kestrel.utils.errors import ConfigError
from tests.serve.conftest import RunningServer
from tests.test_cli import run

TINY_WORKLOAD = [
    "--concurrency", "1,3", "--turns", "2", "--history-tokens", "300", "--append-tokens", "20,40",
    "--reply-tokens", "8,16", "--think-time-s", "0", "--num-gpus", "2", "--no-progress",
]  # fmt: skip
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    s = RunningServer()
    yield s
    s.close()


def test_sweep_against_kestrel(server, tmp_path, capsys):
    code, out, err = run(
        capsys, "bench", "agent", "--base-url", f"{server.url}/v1", "--out", str(tmp_path), *TINY_WORKLOAD
    )
    assert code == 0, err
    result = json.loads((tmp_path / "agent.json").read_text())
    assert {"command", "date", "config", "server", "definitions", "levels"} <= set(result)
    assert (
        result["command"].startswith("kestrel bench agent --base-url")
        and "--concurrency 1,3" in result["command"]
    )
    server_info = result["server"]
    assert server_info["model"] == "tiny" and server_info["max_model_len"] == 4096
    assert server_info["ignore_eos"] and server_info["include_usage"]
    assert server_info["token_counter"] == "measured" and server_info["chars_per_token"] == pytest.approx(1.0)
    assert server_info["info"]["stats"]["prefix_cache"] is True
    assert [level["concurrency"] for level in result["levels"]] == [1, 3]

    for level in result["levels"]:
        c, s, records = level["concurrency"], level["summary"], level["requests"]
        assert s["num_requests"] == s["num_ok"] == len(records) == 2 * c and s["num_failed"] == 0
        assert s["sessions_ended"] == {"turns": c}
        assert all(r["ok"] and r["error"] is None and r["usage_exact"] for r in records)
        assert all(r["completion_tokens"] == r["max_tokens"] for r in records)  # ignore_eos honoured
        assert s["output_tokens"] == sum(r["completion_tokens"] for r in records)
        assert s["output_tokens_per_s_per_gpu"] == pytest.approx(s["output_tokens_per_s"] / 2)
        for key in ("ttft_s", "e2e_s", "tpot_s", "itl_s"):
            assert s[key]["n"] > 0 and 0 < s[key]["p50"] <= s[key]["p90"] <= s[key]["max"]
        speed = s["decode_tokens_per_s_per_user"]
        assert speed["n"] == 2 * c and 0 < speed["p90"] <= speed["p50"]
        assert s["ttft_s_first_turn"]["n"] == s["ttft_s_later_turns"]["n"] == c
        for session in range(c):
            first, second = (r for r in records if r["session"] == session)
            assert (first["turn"], second["turn"]) == (0, 1)
            # the history grows by the reply and the next tool result
            assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
            assert second["prompt_tokens"] >= first["prompt_tokens"] + first["completion_tokens"] + 20
            assert second["reusable_tokens"] == first["prompt_tokens"] + first["completion_tokens"]
            assert second["start_s"] >= first["start_s"] + first["e2e_s"]
        cache = s["server_cache"]
        assert cache["hit_rate"] > 0 and cache["hit_tokens"] > 0
        assert cache["query_tokens"] == s["prompt_tokens"]  # the server saw exactly these prompts
        assert cache["hit_of_reusable"] > 0
        assert cache["reported"]["server_info:cache_hit_rate"] > 0
    assert server.info()["stats"]["cache_hit_rate"] > 0

    png = (tmp_path / "agent.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 300 and height > 200
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["conc", "reqs", "fail"]
    assert [line.split()[0] for line in lines[2:]] == ["1", "3"]
    assert f"wrote {tmp_path / 'agent.json'}" in err and "Traceback" not in err


def test_workload_is_deterministic_and_sized():
    cfg = AgentBenchConfig(history_tokens=4000, shared_prefix_tokens=600)
    sizer = TextSizer(1.0, ByteTokenizer())
    shared = sizer.cut(TextSource(random.Random("shared")).tool_spec, 600)
    a, again, other = (SessionPlan(cfg, sizer, shared, 4, i) for i in (0, 0, 1))
    assert a.messages == again.messages and a.next_turn() == again.next_turn()
    assert a.messages != other.messages
    assert a.messages[0]["content"].startswith(shared) and other.messages[0]["content"].startswith(shared)
    assert a.messages[0]["content"][600:] != other.messages[0]["content"][600:]  # each session's own part
    total = sum(sizer.count(m["content"]) for m in a.messages)
    assert abs(total - 4000) <= 4 * len(a.messages)  # rounding of each message
    assert [m["role"] for m in a.messages[1:3]] == ["user", "assistant"]
    turn = other.next_turn()
    assert sizer.count(turn.append) == turn.append_tokens and 100 <= turn.append_tokens <= 2000
    assert 50 <= turn.reply_tokens <= 500 and turn.think_s == 0  # no think time before the first turn
    assert 0 <= other.next_turn().think_s <= 2
    assert len(TextSizer(3.5).cut(TextSource(random.Random(0)).tool_block, 1000)) == 3500


# -- other engines -------------------------------------------------------------------------------------------


def _fake_engine(calls: list[dict]) -> httpx.MockTransport:
    """An OpenAI-compatible server that refuses `ignore_eos`, has no /get_server_info, and counts prefix-cache
    hits in Prometheus counters like vLLM; replies stop at half of max_tokens (an early EOS)."""
    counters = {"hits": 0, "queries": 0}

    def sse(obj) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "other"}]})
        if request.url.path == "/metrics":
            text = "# TYPE vllm:prefix_cache_hits_total counter\n"
            text += f'vllm:prefix_cache_hits_total{{engine="0"}} {counters["hits"]}\n'
            text += f'vllm:prefix_cache_queries_total{{engine="0"}} {counters["queries"]}\n'
            return httpx.Response(200, text=text)
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        calls.append(body)
        if "ignore_eos" in body:
            return httpx.Response(
                400, json={"error": {"message": "Unrecognized request argument: ignore_eos"}}
            )
        prompt = sum(len(m["content"]) for m in body["messages"]) // 4 + 5
        counters["queries"] += prompt
        counters["hits"] += prompt // 2
        n = max(1, body["max_tokens"] // 2)
        events = [sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})]
        events += [sse({"choices": [{"index": 0, "delta": {"content": "tok "}}]}) for _ in range(n)]
        events.append(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": 7},
        }
        events += [sse({"choices": [], "usage": usage}), b"data: [DONE]\n\n"]
        return httpx.Response(200, content=b"".join(events), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_other_engine_without_kestrel_extensions():
    calls = []
    cfg = AgentBenchConfig(
        base_url="http://other:9000/v1",
        api_key="secret",
        concurrency=(2,),
        turns=3,
        history_tokens=2000,
        append_tokens=Spread.parse("100,200", integer=True),
        reply_tokens=Spread.parse("10", integer=True),
        think_time_s=Spread.parse("0"),
    )
    result = run_sweep(cfg, progress=False, transport=_fake_engine(calls))
    assert result["server"]["model"] == "other" and result["server"]["ignore_eos"] is False
    assert result["server"]["max_model_len"] is None and result["server"]["info"] is None
    assert result["server"]["chars_per_token"] == pytest.approx(4.0, rel=0.02)  # measured from usage
    assert "ignore_eos" not in calls[-1] and calls[-1]["stream_options"] == {"include_usage": True}
    assert calls[-1]["model"] == "other" and calls[-1]["max_tokens"] == 10
    assert result["config"]["api_key"] == "***" and "secret" not in json.dumps(result)
    (level,) = result["levels"]
    s = level["summary"]
    assert s["num_ok"] == 6 and s["output_tokens"] == 30 and s["cached_tokens"] == 42
    assert s["server_cache"]["hit_rate"] == pytest.approx(0.5, abs=0.01)
    assert "metrics:vllm:prefix_cache_hits_total" in s["server_cache"]["tiers"]
    assert all(r["finish_reason"] == "stop" for r in level["requests"])
    assert "2" in format_table(result).splitlines()[2].split()[0]


def _held_back_engine(calls: list[dict]) -> httpx.MockTransport:
    """A server that holds a reply's text back to the end (as Kestrel does for ids outside the tokenizer) but
    sends each token's logprobs in a chunk of its own when asked for them."""

    def sse(obj) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "held"}]})
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        calls.append(body)
        n = body["max_tokens"]
        events = [sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
        if body.get("logprobs"):
            lp = {"content": [{"token": "?", "logprob": -1.0, "bytes": None, "top_logprobs": []}]}
            events += [sse({"choices": [{"index": 0, "delta": {}, "logprobs": lp}]}) for _ in range(n - 1)]
        events.append(
            sse({"choices": [{"index": 0, "delta": {"content": "x" * n}, "finish_reason": "length"}]})
        )
        usage = {"prompt_tokens": 50, "completion_tokens": n}
        events += [sse({"choices": [], "usage": usage}), b"data: [DONE]\n\n"]
        return httpx.Response(200, content=b"".join(events), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("token_chunks", [False, True])
def test_token_chunks_time_tokens_whose_text_is_held_back(token_chunks):
    calls = []
    cfg = AgentBenchConfig(
        base_url="http://held:9000/v1",
        concurrency=(2,),
        turns=2,
        history_tokens=200,
        append_tokens=Spread.parse("20", integer=True),
        reply_tokens=Spread.parse("12", integer=True),
        think_time_s=Spread.parse("0"),
        chars_per_token=1.0,
        token_chunks=token_chunks,
    )
    result = run_sweep(cfg, progress=False, transport=_held_back_engine(calls))
    requests = result["levels"][0]["requests"]
    assert len(requests) == 4 and all(r["ok"] for r in requests)
    assert all(c.get("logprobs") is (True if token_chunks else None) for c in calls[-4:])
    if token_chunks:  # every token timed: 12 chunks, the speed of each reply measured
        assert all(r["num_chunks"] == 12 and r["decode_tokens_per_s"] > 0 for r in requests)
        assert "--token-chunks" in result["command"]
    else:  # one text chunk a reply: no decode speed to measure
        assert all(r["num_chunks"] == 1 and r["decode_tokens_per_s"] is None for r in requests)


# -- statistics ----------------------------------------------------------------------------------------------


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        xs = rng.exponential(size=n).tolist()
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2


def test_summaries():
    lat = latency_stats([0.4, None, 0.1, 0.2, 0.3])
    assert lat["n"] == 4 and lat["mean"] == pytest.approx(0.25) and lat["max"] == 0.4
    assert lat["p50"] == pytest.approx(0.25) and lat["p90"] == pytest.approx(0.37)
    speed = speed_stats([10.0, 20.0, 30.0, 40.0, 50.0])
    assert speed["p50"] == 30.0 and speed["p90"] == pytest.approx(14.0)  # the slow tail
    assert latency_stats([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}

    def record(session, turn, ok=True, completion=10, ttft=0.1, speed=50.0):
        return {
            "session": session, "turn": turn, "ok": ok, "prompt_tokens": 100 if ok else None,
            "completion_tokens": completion if ok else None, "cached_tokens": None, "reusable_tokens": 90 * turn,
            "ttft_s": ttft, "e2e_s": ttft + 0.2, "tpot_s": 1 / speed, "decode_tokens_per_s": speed,
        }  # fmt: skip

    records = [
        record(0, 0, ttft=1.0),
        record(0, 1, speed=100.0),
        record(1, 0, ttft=2.0),
        record(1, 1, ok=False),
    ]
    s = summarize_level(records, duration_s=2.0, num_gpus=4, itls=[0.01, 0.03])
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (4, 3, 1)
    assert s["output_tokens"] == 30 and s["prompt_tokens"] == 300 and s["reusable_prompt_tokens"] == 90
    assert s["output_tokens_per_s"] == 15 and s["output_tokens_per_s_per_gpu"] == 3.75
    assert s["total_tokens_per_s"] == 165 and s["requests_per_s"] == 1.5
    assert s["ttft_s_first_turn"]["p50"] == 1.5 and s["ttft_s_later_turns"]["n"] == 1
    assert s["decode_tokens_per_s_per_user"]["p50"] == 50.0 and s["itl_s"]["p50"] == pytest.approx(0.02)
    assert summarize_level([], 0.0, 1)["output_tokens_per_s"] is None


def test_cache_deltas_per_tier():
    before = {"server_info": {"cache_hit_tokens": 100, "cache_query_tokens": 400, "host_hit_tokens": 0}}
    after = {
        "server_info": {
            "cache_hit_tokens": 400, "cache_query_tokens": 800, "host_hit_tokens": 40, "cache_hit_rate": 0.4,
        },
        "metrics": {},
    }  # fmt: skip
    d = cache_deltas(before, after, reusable_tokens=600)
    assert (d["hit_tokens"], d["query_tokens"], d["hit_rate"]) == (300, 400, 0.75)
    assert d["hit_of_reusable"] == 0.5
    assert d["tiers"]["server_info:host_hit_tokens"]["hit_rate"] == 0.1  # against the main queries
    assert d["reported"] == {"server_info:cache_hit_rate": 0.4}
    assert cache_deltas({"server_info": {}, "metrics": {}}, {"server_info": {}, "metrics": {}}, 10) is None


# -- bad input -----------------------------------------------------------------------------------------------


def _one_line(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.match(r"^kestrel( bench agent)?: error: ", lines[0]), lines[0]
    for word in words:
        assert word in lines[0], lines[0]


def test_unreachable_server_is_one_line(capsys, tmp_path):
    code, _, err = run(
        capsys, "bench", "agent", "--base-url", "http://127.0.0.1:1/v1", "--out", str(tmp_path / "r")
    )
    assert code == 1
    _one_line(err, "cannot reach", "127.0.0.1:1")
    assert not (tmp_path / "r").exists()


def test_an_out_that_is_a_file_is_one_line_naming_it(capsys, tmp_path):
    """A file where the result folder goes was mkdir's bare "[Errno 17] File exists", no option named."""
    (tmp_path / "f").write_text("kept")
    code, _, err = run(capsys, "bench", "agent", "--out", str(tmp_path / "f"))
    assert code == 1
    _one_line(err, "--out", "not a folder")
    code, _, err = run(capsys, "bench", "agent", "--out", str(tmp_path / "f" / "sub"))
    assert code == 1
    _one_line(err, "--out")
    assert (tmp_path / "f").read_text() == "kept"


def test_server_refusals_are_one_line(server, capsys, tmp_path):
    url = ["--base-url", f"{server.url}/v1", "--out", str(tmp_path), "--no-progress"]
    code, _, err = run(capsys, "bench", "agent", *url, "--model", "nope")
    assert code == 1
    _one_line(err, "'nope'", "tiny")
    code, _, err = run(capsys, "bench", "agent", *url, "--history-tokens", "4000", "--concurrency", "1")
    assert code == 1
    _one_line(err, "--history-tokens 4000", "context of 4096")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--concurrency", "1,x"], ["--concurrency", "1,x"]),
        (["--concurrency", "0"], ["--concurrency"]),
        (["--append-tokens", "300,100"], ["--append-tokens", "low end"]),
        (["--reply-tokens", "exp:3"], ["--reply-tokens"]),
        (["--think-time-s", "-1"], ["--think-time-s"]),
        (["--think-time-s", "exp:inf"], ["--think-time-s", "exp:inf"]),
        (["--turns", "0"], ["--turns"]),
        (["--num-gpus", "two"], ["--num-gpus", "two"]),
    ],
)
def test_bad_arguments_are_one_line(capsys, argv, words):
    code, _, err = run(capsys, "bench", "agent", *argv)
    assert code == 2
    _one_line(err, *words)


def test_config_checks():
    with pytest.raises(ConfigError, match="--shared-prefix-tokens"):
        AgentBenchConfig(history_tokens=100, shared_prefix_tokens=200)
    with pytest.raises(ConfigError, match="--base-url"):
        AgentBenchConfig(base_url="localhost:8000")
    assert Spread.parse("exp:1.5") == Spread("exp", 1.5, 1.5) and str(Spread.parse("0,2")) == "0,2"
    assert AgentBenchConfig().max_turns == 5 and AgentBenchConfig(duration_s=10).max_turns is None


def test_an_earlier_sweep_is_kept(capsys, tmp_path, monkeypatch):
    """A folder holding a sweep is refused without --overwrite (the new sweep wrote over agent.json at its first
    level); the default folder, named by the date, moves to <date>-agent-2 past the day's first sweep."""
    import datetime

    from kestrel.bench.agent.cli import _free_folder

    (tmp_path / "agent.json").write_text("earlier")
    code, _, err = run(
        capsys, "bench", "agent", "--base-url", "http://127.0.0.1:1/v1", "--out", str(tmp_path)
    )
    assert code == 1
    _one_line(err, "already holds a sweep", "--overwrite")
    assert (tmp_path / "agent.json").read_text() == "earlier"
    code, _, err = run(
        capsys, "bench", "agent", "--base-url", "http://127.0.0.1:1/v1", "--out", str(tmp_path), "--overwrite"
    )
    _one_line(err, "cannot reach")  # past the check: it went on to the sweep
    monkeypatch.chdir(tmp_path)
    day = Path("bench/results") / f"{datetime.date.today().isoformat()}-agent"
    assert _free_folder(day) == day
    for i in ("", "-2"):
        (tmp_path / f"{day}{i}").mkdir(parents=True)
        (tmp_path / f"{day}{i}" / "agent.json").write_text("{}")
    (tmp_path / f"{day}-3").mkdir()  # a folder without a sweep is free
    assert _free_folder(day) == Path(f"{day}-3")
