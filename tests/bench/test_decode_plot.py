"""`kestrel bench plot-decode`: a `bench decode` result drawn as each point's step cut into bytes, launches and
the rest, with issue 4's targets; clear errors for a file that is no such result."""

from __future__ import annotations

import json

import pytest

from kestrel.bench.decode_plot import bars
from kestrel.serve.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _result() -> dict:
    """Session 46's batch-1 and batch-256 points at 4K (its call D, `bench decode --profile`), and a 128K one."""
    run = {"context": 4096, "attention": "DSA", "sampling": "greedy"}
    return {
        "benchmark": "decode",
        "model": "mini",
        "date": "2026-12-04T19:13:51+00:00",
        "gpu": "NVIDIA H200",
        "ceilings": {"copy_TBps": 4.2517, "launch_floor_us": 0.97712},
        "runs": [
            {**run, "batch": 1, "step_ms": 1.42707, "graph_replay_ms": 1.40317, "bytes": {"total": 1773310016.0},
             "launch_floor": {"kernels": 244.0, "launches_ms": 0.238417}},
            {**run, "batch": 256, "step_ms": 6.41426, "graph_replay_ms": 6.33274,
             "bytes": {"total": 16349421631.9}, "launch_floor": {"kernels": 406.0, "launches_ms": 0.396711}},
            {**run, "batch": 1, "context": 130984, "attention": "dense MLA", "step_ms": 3.088,
             "bytes": {"total": 2.64e9}},
            {**run, "batch": 64, "max_model_len": 131072, "graph_width": 8192, "step_ms": 3.9,
             "bytes": {"total": 9.1e9}},
        ],
    }  # fmt: skip


def test_bars_cut_each_step_and_place_the_targets():
    one, many, dense, short = bars(_result())
    assert one["bytes_ms"] == pytest.approx(1773310016.0 / 4.2517e12 * 1e3)  # 0.4171 ms
    assert one["bytes_ms"] / one["step_ms"] == pytest.approx(0.2923, abs=1e-4)  # session 46's MBU
    assert one["bytes_ms"] + one["launches_ms"] + one["rest_ms"] == pytest.approx(one["step_ms"])
    # the step 70% MBU allows at batch 1, 60% at batch 256; no target for dense attention or at 128K
    assert (one["target"], many["target"], dense["target"]) == (0.70, 0.60, None)
    assert one["target_ms"] == pytest.approx(one["bytes_ms"] / 0.70)
    assert dense["launches_ms"] is None and dense["replay_ms"] is None and dense["target_ms"] is None
    assert dense["rest_ms"] == pytest.approx(3.088 - dense["bytes_ms"])
    assert (one["label"], dense["label"]) == ("batch 1, 4K, DSA", "batch 1, 127.9K, dense MLA")
    # on an engine of serve's default limit, replaying a short graph (`--cuda-graph-short-len`)
    assert short["label"] == "batch 64, 4K, DSA, limit 128K, graph 8K" and short["target"] is None


def test_plot_decode_draws_a_real_result(tmp_path):
    """A result `bench decode` made (tiny, on the CPU: its figures mean nothing) and session 46's, drawn."""
    from kestrel.bench.decode import decode_bench

    real = decode_bench("tiny", batches=(1, 2), contexts=(16,), steps=2, dense_contrast=False, device="cpu")
    for name, result in (("tiny", real), ("s46", _result())):
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
        assert main(["bench", "plot-decode", str(tmp_path / f"{name}.json")]) == 0
        assert (tmp_path / f"{name}.png").read_bytes().startswith(PNG)
    # a gpu_suite section or a session record's call holds the result under "decode"; --out names the PNG
    (tmp_path / "call.json").write_text(json.dumps({"call": "D", "decode": _result()}))
    assert (
        main(["bench", "plot-decode", str(tmp_path / "call.json"), "--out", str(tmp_path / "d" / "x.png")])
        == 0
    )
    assert (tmp_path / "d" / "x.png").read_bytes().startswith(PNG)


def test_plot_decode_refuses_what_is_no_decode_result(tmp_path, capsys):
    """One line naming the file and what is wrong with it; exit code 2; no PNG."""
    cases = {  # file -> (its text, what the line says)
        "missing.json": (None, "No such file"),
        "text.json": ("not json", "JSONDecodeError"),
        "kernels.json": (
            json.dumps({"benchmark": "kernels", "runs": []}),
            "not a `kestrel bench decode` result",
        ),
        "empty.json": (
            json.dumps({"benchmark": "decode", "runs": [], "ceilings": {}}),
            "no benchmark 'decode' with runs",
        ),
        "list.json": (json.dumps([1, 2]), "not a `kestrel bench decode` result"),
        "no_ceilings.json": (
            json.dumps({"benchmark": "decode", "runs": [{"batch": 1}]}),
            "without 'ceilings'",
        ),
        "short_run.json": (json.dumps({**_result(), "runs": [{"batch": 1}]}), "without 'step_ms'"),
        # hand-edited or cut-short figures: a division by zero (a traceback) before
        "zero_step.json": (
            json.dumps({**_result(), "runs": [{**_result()["runs"][0], "step_ms": 0}]}),
            "a step of 0 ms",
        ),
        "zero_copy.json": (json.dumps({**_result(), "ceilings": {"copy_TBps": 0}}), "a copy rate of 0"),
    }
    for name, (text, says) in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        assert main(["bench", "plot-decode", str(tmp_path / name)]) == 2
        out = capsys.readouterr().err.strip().splitlines()  # errors on stderr
        assert len(out) == 1 and out[0].startswith(f"kestrel bench plot-decode: {tmp_path / name}: "), out
        assert says in out[0]
        assert not (tmp_path / name).with_suffix(".png").exists()


def test_plot_decode_writes_the_png_it_names(tmp_path, capsys):
    """--out is the PNG's name as given: without a suffix matplotlib wrote NAME.png and the command said it
    wrote NAME; a folder (NAME.png beside it, "wrote NAME") is refused in one line."""
    (tmp_path / "r.json").write_text(json.dumps(_result()))
    assert main(["bench", "plot-decode", str(tmp_path / "r.json"), "--out", str(tmp_path / "picture")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'picture'}"
    assert (tmp_path / "picture").read_bytes().startswith(PNG)
    (tmp_path / "d").mkdir()
    assert main(["bench", "plot-decode", str(tmp_path / "r.json"), "--out", str(tmp_path / "d")]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "d.png").exists()


def test_plot_decode_writes_the_format_its_suffix_names(tmp_path, capsys):
    """--out x.pdf was a PNG named x.pdf; a suffix matplotlib writes no format for is refused in one line naming
    it, before the result is read (a missing one here)."""
    pytest.importorskip("matplotlib")
    (tmp_path / "r.json").write_text(json.dumps(_result()))
    for name, magic in (("x.pdf", b"%PDF"), ("x.svg", b"<?xml"), ("x.PNG", PNG)):
        assert main(["bench", "plot-decode", str(tmp_path / "r.json"), "--out", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes().startswith(magic), name
    capsys.readouterr()
    assert main(["bench", "plot-decode", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.xyz")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kestrel bench plot-decode: --out {tmp_path / 'x.xyz'}: ") and ".xyz" in line
    assert ".pdf" in line and not (tmp_path / "x.xyz").exists()
