"""scripts/bench_grammar.py runs (quick: a 20,000-token synthetic vocabulary) and writes every case's figures;
xgrammar's side where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_grammar_quick(tmp_path):
    out = tmp_path / "grammar.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_grammar.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["date"] and result["command"]
    cases = result["cases"]
    assert any(name.endswith("/schema_person") for name in cases) and len(cases) >= 4
    for case in cases.values():
        k = case["kestrel"]
        assert case["tokens"] > 0 and k["compile_ms"] > 0 and k["cold"]["mean_us"] > 0
        if "xgrammar" in case:
            assert "/" in case["xgrammar"]["masks_equal_to_kestrels"]
