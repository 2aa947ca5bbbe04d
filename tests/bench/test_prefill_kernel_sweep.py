"""scripts/prefill_kernel_sweep.py --smoke: the sweep's kernels and checks run at tiny sizes (on the CPU in Triton's
interpreter; a subprocess, which sets TRITON_INTERPRET before Triton is imported), so that a Python error shows up
here rather than in rented GPU minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_smoke_writes_checked_variants(tmp_path):
    pytest.importorskip("triton")
    script = str(ROOT / "scripts/prefill_kernel_sweep.py")
    cmd = [sys.executable, script, "--smoke", "--only", "indexer,expanded"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "prefill_kernel_sweep.json").read_text())
    # two tilings, then the default without NaN fill; two tilings of the attention
    assert [r["fill_past"] for r in record["indexer"]] == [True, True, False]
    assert len(record["expanded"]) == 2 and record["topk"] == []
    for row in record["indexer"] + record["expanded"]:
        assert row["ms"] > 0 and row["rel_err"] < 1e-4  # every variant was checked against the first
