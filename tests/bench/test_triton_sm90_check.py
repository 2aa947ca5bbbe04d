"""scripts/triton_sm90_check.py: the DSA top-k kernels compile for the H200 (sm_90) on the CPU, with registers
reported and nothing spilled. It catches what the interpreter does not run (a global read inside a kernel, a
tile that spills) before rented GPU minutes do; a subprocess, so that no TRITON_INTERPRET=1 set by another test
turns the kernels into interpreted ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_topk_kernels_compile_for_sm90_without_spills():
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip("this Triton has no bundled CUDA tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "scripts/triton_sm90_check.py"), "topk"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["kernel"] for r in rows] == [
        "_coarse_kernel",
        "_fine_kernel",
        "_compact_kernel",
        "_select_kernel",
    ]
    for r in rows:
        assert 0 < r["REG"] <= 255 and r["STACK"] == 0 and r["SHARED"] <= 227 * 1024, r
