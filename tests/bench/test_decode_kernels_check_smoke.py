"""scripts/decode_kernels_check.py --smoke: every section runs on the CPU under Triton's interpreter at tiny sizes
(so a Python error shows up here rather than in GPU minutes), and every sort, MLA launch configuration and MoE
tile gives the reference's answer."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests import early

ROOT = Path(__file__).resolve().parents[2]


def _start() -> early.Child:
    """The script in a child started when collection ends (tests/early.py), on one thread."""
    out = Path(tempfile.mkdtemp(prefix="decode_kernels_check-")) / "decode_kernels.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "decode_kernels_check.py"), "--smoke", "--out", str(out)]
    return early.spawn_interpreted(cmd)


early.register("decode_kernels_check", _start)


@pytest.mark.early("decode_kernels_check")
def test_decode_kernels_check_smoke():
    child = early.child("decode_kernels_check")
    returncode, _, stderr = child.result(timeout=300)
    assert returncode == 0, stderr[-2000:]
    out = Path(child.proc.args[-1])  # the --out file _start named
    result = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    assert "errors" not in result, result.get("errors")
    sorts = {k: v for k, v in result["moe_sort"].items() if k.startswith("M=")}
    assert len(sorts) == 3
    for case, entry in sorts.items():
        assert set(entry) == {"one_program", "per_block", "torch_sort"}, case
        assert all(v["equal"] for v in entry.values()), (case, entry)
    for B in ("B=1", "B=3"):
        entry = result["mla_decode"][B]
        assert entry["default"]["us"] > 0 and entry["configs"]
        assert all(c["close"] for c in entry["configs"]), entry["configs"]
        assert entry["best"] is not None
    for T in ("T=1", "T=5"):
        entry = result["moe_tiles"][T]
        assert entry["default"]["us"] > 0 and len(entry["gate_up"]) == len(entry["down"]) == 2
        assert all(c["close"] for c in entry["gate_up"] + entry["down"]), entry
    layout = result["mla_layout"]["B=3"]
    for way in ("sparse", "sparse_chained", "rows_page1", "sparse block_n=16", "rows_page1 block_n=16"):
        assert layout[way]["close_to_sparse"], (way, layout[way])
    assert layout["contiguous"]["us"] > 0 and layout["gather_copy"]["us"] > 0
    for N in ("N=1", "N=3"):
        entry = result["kda_step"][N]
        assert entry["configs"] and all(c["close"] for c in entry["configs"]), entry["configs"]
    anatomy = result["moe_anatomy"]
    for part in ("gate_up", "down"):
        assert anatomy[part]["tiles"] and all(t["close"] for t in anatomy[part]["tiles"]), anatomy[part]
    assert anatomy["whole_call_random_us"] > 0 and anatomy["whole_call_balanced_us"] > 0
    small = result["small_kernels"]
    knobs = [k for key, v in small.items() if key.startswith("sort M=") for k in v]
    assert knobs and all(k["equal"] for k in knobs), knobs
    routers = [small[f"router T={T}"] for T in (1, 4)]
    assert all(v for r in routers for k, v in r.items() if k.startswith("same_experts")), routers
    assert len(routers[0]) == 10 and len(routers[1]) == 2  # batch 1 sweeps the slices; past it one setting
    # pdl and gemv: off the GPU both modes run the same code (no PDL, cuBLAS's place taken by F.linear on the
    # CPU), so these show the sections run; their comparisons mean something on the H200 only
    assert all(entry["same_bits"] for entry in result["pdl"]["batches"].values()), result["pdl"]
    gemv = result["gemv"]
    assert len(gemv) == 4 and all(entry["close"] for entry in gemv.values()), gemv
    fused = result["moe_fused"]
    assert fused["one_launch"] and all(r["close"] for r in fused["one_launch"]), fused["one_launch"]
    assert fused["best"] is not None and fused["six_launches_us"] > 0
    # off the GPU the one launch already runs phased: the same code, so the same bits
    phased = fused["best_phased"]
    assert phased["us"] > 0 and phased["same_bits_as_one_launch"], phased
    ahead = result["l2_ahead"]
    assert ahead["cold_us_a_layer"] > 0 and ahead["hot_us_a_layer"] > 0 and ahead["layers"] == 3, ahead
    # one program on the CPU: the chain's code runs, checked against torch
    (persistent,) = ahead["persistent"]
    assert persistent["ok"] and persistent["us_a_layer"] > 0 and ahead["persistent_best"] == persistent, ahead
    (barriers,) = ahead["barriers_only"]
    assert barriers["ok"] and barriers["us_a_layer"] > 0, ahead
    by_phase = fused["by_phase"]
    assert set(by_phase["one_launch_phases_us"]) == {"router", "gate_up_and_routing", "down_and_combine"}
    assert all(us > 0 for us in by_phase["one_launch_phases_us"].values()), by_phase
    assert by_phase["six_router_us"] > 0 and by_phase["six_experts_us"] > 0, by_phase
    assert set(by_phase["floors_us"]) == set(by_phase["one_launch_phases_us"]), by_phase
    picks = result["argmax"]["batches"]
    assert len(picks) == 2 and all(e["same"] and len(e["triton_us"]) == 2 for e in picks.values()), picks
    sampling = result["sampling"]["batches"]
    assert len(sampling) == 2, sampling
    for entry in sampling.values():
        close = entry["logprobs_max_diff"] < 1e-5
        assert entry["logprobs_same_ids"] and close and entry["penalties_same"], entry
