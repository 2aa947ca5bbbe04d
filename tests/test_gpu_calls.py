"""scripts/gpu_calls.py, the committed device calls: every job's commands take the options they are given (a typo
would cost a device call), each result's summary reads the records the H200 returned, and a call runs, packs and
summarizes its results (the `served` job, which runs on the CPU as well)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kestrel.presets import shipped_model_dir
from tests.scripts import load_script

calls = load_script("gpu_calls")
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _record(session: str) -> dict:
    return json.loads((RESULTS / f"2026-12-04-h200-session{session}.json").read_text())


def test_every_job_plans_and_its_commands_take_their_options():
    args = {"served": "KESTREL_PDL=off", "ab": "KESTREL_PDL=auto/off:1"}
    jobs = [f"{name}:{args[name]}" if name in args else name for name in calls.JOBS]
    runs = calls.plan([*jobs, "served:--cuda-graph-short-len=8192"])
    tags = {r.tag for r in runs}
    assert tags >= {"tests", "decode", "topk", "prefill", "kernels", "served_pdl_off", "ab_pdl_off_0"}
    (ab,) = [r for r in runs if r.tag == "ab_pdl_auto_0"]
    assert ab.env == {"KESTREL_PDL": "auto"} and "1,4,16,256" in ab.argv
    (short,) = [r for r in runs if r.tag == "served_cuda_graph_short_len_8192"]
    assert "--cuda-graph-short-len=8192" in short.argv and not short.env
    assert calls.dry_run(runs) == []


def test_a_bad_option_or_job_is_caught_before_the_call():
    bad = calls.Run("x", [calls.PY, calls._script("topk_cuda_check.py"), "--outt", "x.json"], 1)
    missing = calls.Run("y", [calls.PY, calls._script("no_such_script.py")], 1)
    assert calls.dry_run([bad, missing]) == [
        "x: " + calls._script("topk_cuda_check.py") + " takes no --outt",
        "y: no file " + calls._script("no_such_script.py"),
    ]
    with pytest.raises(ValueError, match="unknown job 'decod'"):
        calls.plan(["decod"])
    with pytest.raises(ValueError, match="named twice"):
        calls.plan(["topk", "topk"])
    with pytest.raises(ValueError, match="NAME=VALUE"):
        calls.plan(["served:KESTREL_PDL"])
    assert [r.tag for r in calls.plan(["short:3"])] == ["short8192_0", "short0_0", "short8192_1"]
    assert [r.tag for r in calls.plan(["ab:KESTREL_X=a/b"])] == [
        "ab_x_a_0",
        "ab_x_b_0",
        "ab_x_a_1",
        "ab_x_b_1",
    ]
    for bad in ("ab", "ab:KESTREL_X=a", "ab:KESTREL_X=a/b:5", "ab:=a/b", "ab:KESTREL_X=a/"):
        with pytest.raises(ValueError, match="VAR=A/B"):
            calls.plan([bad])
    for bad in ("short:0", "short:5", "short:x"):
        with pytest.raises(ValueError, match="from 1 to 4"):
            calls.plan([bad])
    with pytest.raises(SystemExit):
        calls.main(["--label", "a/b", "topk"])


def test_summaries_read_the_h200_records():
    """Session 46's decode, top-k and prefill results and session 47's decode at serve's limit, as returned."""
    a, b, c, _ = _record("46")["calls"]
    decode = calls.show_decode(b["decode"])
    assert decode[0] == "copy 4.274 TB/s"
    assert any(
        "b=1   ctx=4096   DSA" in line and "MBU 29.2%" in line and "244 kernels" in line for line in decode
    )
    assert "b=1 DSA: ctx 130984 / 4096 = 1.13x"  # (128K less the steps) in decode
    topk = calls.show_topk(a["topk_cuda"])
    assert "topk_cuda 42.3 us, torch.topk 192.4 us: 4.55x" in topk[0]
    assert ", 0 with a set unlike the reference's []" in topk[1]
    prefill = calls.show_prefill({"sections": {"prefill_bench": {"cases": c["prefill"]}}})
    assert prefill == ["8x4096: 184.0 ms, MFU 34.7%", "1x32768: 323.8 ms, MFU 32.8%"]
    tests = calls.show_gpu_tests({"sections": {"gpu_tests": a["gpu_tests"]}})
    assert tests == ["returncodes [0], {'PASSED': 8}"]
    wide = calls.show_decode(_record("47")["calls"][0]["json"]["decode_new_tight"])
    assert any(line.startswith("b=256 ctx=4096   DSA       max 4184") for line in wide)


@pytest.mark.skipif(shipped_model_dir() is None, reason="the served job serves the shipped model")
def test_a_call_runs_packs_and_summarizes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    args = [
        "served",
        "pdl",
        "--no-setup",
        "--label",
        "t",
        "--budget",
        "600",  # served takes ~60 s on the CPU alone, more beside other work (100 s ran out, session 52)
        "--results",
        str(tmp_path / "r"),
    ]
    # a job that would outrun the budget is skipped, not run
    monkeypatch.setitem(calls.JOBS, "pdl", ("", lambda arg, call: [calls.Run("pdl", ["false"], 10**6)]))
    assert calls.main(args) == 0
    record = json.loads((out / "calls_t.json").read_text())
    served, pdl = record["runs"]
    assert served["returncode"] == 0 and served["shown"][0].startswith("8 of 8 prompts")
    assert pdl["skipped"].endswith("estimate 1000000 s")
    capsys.readouterr()
    calls.main(["--summarize", str(out / "t.tgz"), "--record", str(tmp_path / "record.json")])
    printed = capsys.readouterr().out
    assert "== served: rc 0" in printed and "8 of 8 prompts gave the reference's tokens" in printed
    (call,) = json.loads((tmp_path / "record.json").read_text())["calls"]
    assert call["label"] == "t" and call["runs"][0]["result"]["same"] == 8 and "result" not in call["runs"][1]


def test_cut_gpu_tests_read_their_log(tmp_path):
    """The tests job cut by the budget leaves no JSON: its summary counts the outcomes in pytest's log so far."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "gpu_tests.log").write_text(
        "tests/ops/test_a.py::test_x PASSED [ 10%]\n"
        "[gw1] [ 20%] FAILED tests/ops/test_b.py::test_y[2]\n"
        "[gw0] [ 30%] PASSED tests/ops/test_b.py::test_z\n"
    )
    (run,) = calls.plan(["tests"], calls.Call(results=tmp_path))
    assert calls.shown(run, tmp_path) == [
        "cut: {'FAILED': 1, 'PASSED': 2} so far",
        "FAILED tests/ops/test_b.py::test_y[2]",
    ]


def test_cuda_chain_lines_name_the_best_correct_chain_and_the_traced_spans():
    """Session 64's call c as recorded: the best chain that computes the right thing (not a no_barrier or
    no_stream probe, whatever their times), and a traced row's medians."""
    record = json.loads((RESULTS / "2026-12-06-h100-session64.json").read_text())
    rows = record["calls"][2]["runs"][0]["result"]["l2_ahead"]["cuda_chain"]
    lines = calls._cuda_chain_lines(rows)
    assert lines == ["l2_ahead cuda chain best: 10.44 us a layer (pipe, ll, mma, mma_packed, depth 2)"]
    traced = dict(
        pipe=True, mma=True, trace={"input_wait_us": {"median": 1.25, "max": 3.0}}, ok=True, us_a_layer=9.0
    )
    assert calls._cuda_chain_lines([traced]) == [
        "l2_ahead cuda chain best: 9.00 us a layer (pipe, mma)",
        "  traced pipe, mma: 9.00 us a layer; input_wait 1.25",
    ]
    shape = dict(stages=3, period=4.0, period_mean=4.5, latency_max=1.5, latency=1.0, critical_latency=1.25)
    shape |= dict(sums=0.5, critical_sums=0.75)
    traced["trace"]["by_class"] = {"16x32": shape}
    assert calls._cuda_chain_lines([traced])[2] == (
        "    16x32: period 4.00 (mean 4.50, last input in 1.50); a block / the last block: latency 1.00/1.25, sums "
        "0.50/0.75"
    )
