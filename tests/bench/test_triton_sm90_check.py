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


def test_rows_gemv_loads_its_weights_before_the_pdl_wait():
    """The rows GEMV (kestrel.ops.linear.triton_gemv) at mini's width for sm_90, with K and the pointers multiples
    of 16 as at launch: no spills, and its weight slice as 16-byte loads, every one before griddepcontrol.wait,
    then x's after it (early); with early off, every load after the wait; with KDA's norm-gate inside, or its conv
    step after, the same weight loads first."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip("this Triton has no bundled CUDA tools")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sig = {"x": "*bf16", "K": "i32", "stride_xm": "i32"}
    for i in range(6):
        sig |= {f"w{i}": "*bf16", f"out{i}": "*bf16", f"n{i}": "i32"}
    sig |= {f"first{i}": "i32" for i in range(1, 6)}
    sig |= {"gate": "*bf16", "gm_units": "i32", "norm_w": "*bf16", "eps": "fp32"}
    sig |= {"conv_w": "*bf16", "pool": "*bf16", "slots": "*i32", "planes": "*bf16"}
    sig |= dict.fromkeys(("C", "PC", "stride_ps", "stride_pc", "blocks"), "i32")
    plain = {"M": 1, "BN": 8, "KP": 2048, "SEGS": 1, "PDL": True}  # GATE, CONV: the kernel's defaults
    # mini's KDA o projection with its norm-gate inside (16 rows of 1024: eight 16-byte loads a thread too), two
    # rows, the gate a column slice of the 4232-wide in-projection (its row stride passed as units of 8 elements)
    gated = {"M": 2, "BN": 16, "KP": 1024, "SEGS": 1, "PDL": True, "GATE": 2, "G": 128, "G_ALIGN": 8}
    # mini's KDA input projection with its conv step after (W 4): the window's and slot's loads after the wait
    conv = {**plain, "CONV": True, "W": 4, "WP": 4}
    # a grid smaller than the slices: the first slice before the wait, the next ones' inside the walk
    walk = {**plain, "PERSIST": True}
    for const, early in ((plain, True), (plain, False), (gated, True), (conv, True), (walk, True)):
        const = {**const, "EARLY": early}
        cmd = [sys.executable, str(ROOT / "scripts/triton_sm90_check.py"), "kernel"]
        cmd += ["kestrel.ops.linear.triton_gemv:_gemv_rows_kernel", "--sig", json.dumps(sig)]
        cmd += [
            "--const",
            json.dumps(const),
            "--warps",
            "8",
            "--div",
            "x,K,stride_xm,w0,out0,gate,norm_w,conv_w,pool,planes,C,PC,stride_ps,stride_pc",
        ]
        cmd += ["--ptx", "ld.global", "--ptx", "griddepcontrol.wait"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        usage = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
        assert 0 < usage["REG"] <= 128 and usage["STACK"] == 0, usage
        ptx = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
        wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
        loads = [i for i, line in enumerate(ptx) if "ld.global" in line]
        before = [i for i in loads if i < wait]
        assert all("ld.global.v4" in ptx[i] for i in before), ptx  # the weights' 16 bytes a load
        # 8 x 2048 bf16 over 256 threads: eight 16-byte loads a thread before the wait (early)
        assert len(before) == (8 if early else 0), ptx
        if not const.get("CONV"):  # then x's (and the gate's, the norm's), all vectors
            assert all("ld.global.v" in ptx[i] for i in loads), ptx
        if not const.get("GATE") and not const.get("CONV"):  # x's one (and the next slice's eight)
            assert len(loads) == (17 if const.get("PERSIST") else 9), ptx
