"""scripts/gpu_suite.py --smoke: every section of the GPU script runs its code on the CPU at tiny sizes, so that
a Python error in a section shows up here rather than in rented GPU minutes. One run of the script (a
subprocess: the sections set KESTREL_* variables), then one check per section: no error anywhere in its JSON,
and the figures it exists to produce."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what each section must report (the smoke sizes: tiny, batch 4, 8 requests)
EXPECTED = {
    "ceilings": {"copy_TBps", "bf16_matmul_TFLOPs"},
    "foundation": {"parity", "generate_tiny", "cli_generate_tiny"},
    "kda_layers": {"tiny"},
    "gpu_tests": {"returncodes", "outcomes", "failed", "skipped"},
    "engine_decode": {"moe_grouped_mm", "plan", "batches", "prefill_4x64_s", "skipped"},
    "profile_decode": {"wall_ms_per_step", "cuda_ms_per_step", "kernel_launches_per_step", "top_kernels"},
    "engine_bench": {
        "workload",
        "transformers_batch4",
        "kestrel_kimi_linear_batch4",
        "ratio_kestrel_over_transformers_batch4",
        "kestrel_tiny_dsa_8_requests",
    },
    "bench_kernels": {"ceilings", "kernels"},
    "bench_decode": {"ceilings", "runs"},
    "cache_targets": {
        "ttft_ms_cache_off",
        "ttft_ms_cache_on",
        "ttft_ratio",
        "enough_memory",
        "gpu_25pct_no_host",
        "gpu_25pct_host",
        "host_tier_speedup",
    },
}


@pytest.fixture(scope="module")
def sections(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_suite_smoke")
    cmd = [sys.executable, "scripts/gpu_suite.py", "--smoke", "--sections", "all", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "gpu_suite.json").read_text())
    assert record["gpu"].startswith("none") and set(record["sections"]) == set(EXPECTED)
    return record["sections"]


def _errors(value, where: str = "") -> list[str]:
    """Every `error` entry in a section's JSON, at any depth (cache_targets keeps one per server config)."""
    if isinstance(value, dict):
        found = [f"{where}: {value['error']}"] if "error" in value else []
        return found + [e for k, v in value.items() for e in _errors(v, f"{where}/{k}")]
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in _errors(v, f"{where}[{i}]")]
    return []


@pytest.mark.parametrize("name", list(EXPECTED))
def test_section_runs_on_cpu(sections, name):
    section = sections[name]
    assert not _errors(section, name), _errors(section, name)
    assert EXPECTED[name] <= set(section), EXPECTED[name] - set(section)


def test_smoke_figures_are_real(sections):
    """Beyond "no exception": each section really did its work at the smoke sizes."""
    foundation = sections["foundation"]
    assert set(foundation["parity"]) == {"tiny", "kestrel-demo"}
    assert foundation["parity"]["kestrel-demo"]["prompt"] == "held-out chat prompts, concatenated"
    assert foundation["cli_generate_tiny"]["returncode"] == 0
    assert sections["gpu_tests"]["returncodes"] == [0, 0]  # every test target the GPU run names exists
    assert set(sections["engine_decode"]["batches"]) == {"4", "2", "1"}
    assert sections["profile_decode"]["top_kernels"]
    assert sections["engine_bench"]["kestrel_tiny_dsa_8_requests"]["output_tokens"] == 8 * 8
    assert len(sections["bench_kernels"]["kernels"]) == 6
    decode_runs = sections["bench_decode"]["runs"]
    assert {(r["context"], r["index_keys"]) for r in decode_runs} >= {(4028, "bf16"), (4028, "fp8")}
    for config in ("enough_memory", "gpu_25pct_no_host", "gpu_25pct_host"):
        assert sections["cache_targets"][config]["ttft_s"]["n"] > 0
