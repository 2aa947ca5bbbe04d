"""scripts/pick_demo_run.py: which of two training runs ships (issue 5's rule on their eval JSON)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.scripts import load_script


def _load():
    return load_script("pick_demo_run")


def _run(folder: Path, easy: float, countdown: float, r8k: float) -> str:
    folder.mkdir()
    result = {
        "families": {
            "chain_sum": {"accuracy": easy},
            "basic_arithmetic": {"accuracy": easy},
            "countdown": {"accuracy": countdown},
        },
        "retrieval": {"2048": {"dsa": {"accuracy": 0.9}}, "8192": {"dsa": {"accuracy": r8k}}},
    }
    (folder / "eval.json").write_text(json.dumps(result))
    return str(folder)


def test_better_retrieval_wins_among_qualifying_runs(tmp_path, capsys):
    main = _load().main
    a = _run(tmp_path / "a", 0.95, 0.4, 0.80)
    b = _run(tmp_path / "b", 0.95, 0.4, 0.86)
    c = _run(tmp_path / "c", 0.85, 0.4, 0.99)  # an easy family under 90%: out whatever its retrieval
    d = _run(tmp_path / "d", 0.95, 0.85, 0.99)  # countdown too easy: no room left for RL
    assert main([a, c, b, d, str(tmp_path / "missing")]) == 0
    assert capsys.readouterr().out.strip() == b
    assert main([c, d]) == 1 and capsys.readouterr().out == ""
