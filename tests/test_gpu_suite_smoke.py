"""scripts/gpu_suite.py --smoke: every section of the GPU script runs its code on the CPU at tiny sizes, so that
a Python error in a section shows up here rather than in rented GPU minutes. One run of the script (a
subprocess: the sections set KESTREL_* variables), then one check per section: no error anywhere in its JSON,
and the figures it exists to produce."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
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
    "parity_floor": {"tiny"},
    "gpu_tests": {"parts", "workers", "returncodes", "counts", "outcomes", "failed", "skipped"},
    "engine_decode": {"moe_grouped_mm", "plan", "batches", "prefill_4x64_s", "skipped"},
    "profile_decode": {"wall_ms_per_step", "cuda_ms_per_step", "kernel_launches_per_step", "top_kernels"},
    "prefill_bench": {"ceilings", "cases"},
    "engine_bench": {
        "workload",
        "transformers_batch4",
        "kestrel_kimi_linear_batch4",
        "kestrel_kimi_linear_batch4_first_run",
        "kestrel_kimi_linear_batch4_no_overlap",
        "ratio_kestrel_over_transformers_batch4",
        "kestrel_tiny_dsa_8_requests",
        "kestrel_tiny_dsa_8_requests_first_run",
        "kestrel_tiny_dsa_8_requests_no_overlap",
    },
    "bench_kernels": {"ceilings", "kernels"},
    "bench_decode": {"ceilings", "runs"},
    "cache_targets": {
        "ttft_ms_cache_off",
        "ttft_ms_cache_on",
        "ttft_ratio",
        "ttft_ms_cache_on_runs",
        "ttft_ms_cache_off_runs",
        "ttft_ratio_of_medians",
        "profiled_hit",
        "enough_memory",
        "gpu_25pct_no_host",
        "gpu_25pct_host",
        "host_tier_speedup",
    },
    "agent_sweep": {"levels", "json"},
}


@pytest.fixture(scope="module")
def sections(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_suite_smoke")
    cmd = [sys.executable, "scripts/gpu_suite.py", "--smoke", "--sections", "all", "--out", str(out)]
    cmd += ["--gpu-tests-workers", "2"]  # parsed and recorded (on the CPU the tests are collected only)
    # its own process group: on a timeout the servers it started go down with it (~30 s idle, minutes on a
    # loaded 2-core machine)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-3000:]
    record = json.loads((out / "gpu_suite.json").read_text())
    assert record["gpu"].startswith("none") and set(record["sections"]) == set(EXPECTED)
    env = record["env_at_start"]  # `kestrel env --json`'s report, for the device the suite ran on
    assert env["fast_paths"]["device"] == "cpu" and "variables" in env, env
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
    assert sections["gpu_tests"]["returncodes"] == [0, 0, 0]  # every test target the GPU run names exists
    assert sections["gpu_tests"]["workers"] == 2
    assert set(sections["engine_decode"]["batches"]) == {"4", "2", "1"}
    assert sections["profile_decode"]["top_kernels"]
    packed = sections["prefill_bench"]["cases"]["2x64"]
    assert packed["tokens"] == 128 and packed["step_s"] > 0 and packed["top_kernels"]
    for run in (
        "kestrel_tiny_dsa_8_requests",
        "kestrel_tiny_dsa_8_requests_first_run",
        "kestrel_tiny_dsa_8_requests_no_overlap",
    ):
        assert sections["engine_bench"][run]["output_tokens"] == 8 * 8
    floor = sections["parity_floor"]["tiny"]  # the conditioned init is the one whose bf16 floor is small
    assert floor["conditioned"]["reference_bf16_fp32_reductions"]["norm_rel"] < 0.02
    kernels = sections["bench_kernels"]["kernels"]
    assert len(kernels) == 12  # a row per case; moe: the grouped and the Triton rows
    topk = [k for k in kernels if k["kernel"].startswith("exact top-8")]
    assert [k["kernel"].split()[-1] for k in topk] == ["randn", "ties"]
    assert all(k["equals_reference"] for k in topk)  # the reference set on tied scores as well
    (conv,) = [k for k in kernels if k["kernel"].startswith("KDA conv prefill")]
    assert len(conv["sweep"]) == 6 and all(v["max_abs_vs_default"] == 0 for v in conv["sweep"].values())
    (router,) = [k for k in kernels if k["kernel"].startswith("MoE router")]
    assert router["same_experts_as_peer"] and router["peer_ms"] > 0
    (prefill,) = [
        k for k in sections["bench_kernels"]["kernels"] if k["kernel"].startswith("sparse MLA prefill")
    ]
    assert len(prefill["sweep"]) == 4 and all(v["rel_err"] < 0.05 for v in prefill["sweep"].values())
    expanded = {k: v for k, v in prefill["expanded_kernel"].items() if k != "causal_no_selection"}
    assert len(expanded) == 4 and all(v["rel_err"] < 0.05 for v in expanded.values())
    assert prefill["expanded_kernel"]["causal_no_selection"]["ms"] > 0
    decode_runs = sections["bench_decode"]["runs"]
    assert {(r["context"], r["index_keys"]) for r in decode_runs} >= {(4028, "bf16"), (4028, "fp8")}
    assert {r["max_model_len"] for r in decode_runs if r["context"] == 64} == {
        64 + 4 + 64,
        1024,
    }  # tight, serve's
    serve = [r for r in decode_runs if r["max_model_len"] == 1024]
    assert sorted({r["short_graph_len"] for r in serve}) == [0, 128]  # with and without short graphs
    for config in ("enough_memory", "gpu_25pct_no_host", "gpu_25pct_host"):
        assert sections["cache_targets"][config]["ttft_s"]["n"] > 0
    assert sections["cache_targets"]["profiled_hit"]["top_kernels"]
    sweep = sections["agent_sweep"]["levels"]
    assert [level["concurrency"] for level in sweep] == [1, 2] and all(level["num_ok"] > 0 for level in sweep)


@pytest.fixture
def gpu_suite(monkeypatch):
    """scripts/gpu_suite.py as a module, for its helpers (no section runs)."""
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "scripts" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_tests_parts_split_the_rest_whole(gpu_suite):
    """rest:K/N runs cover rest's files once each, in order, each run deselecting the switch tests; the
    default parts are the whole section; a malformed part is refused before any GPU time goes."""
    (whole,) = gpu_suite.gpu_test_targets(["rest"])
    files = [t for t in whole if not t.startswith("--")]
    assert "tests/ops/test_mla_triton.py" in files and files[-1] == "tests/engine/test_structured_outputs.py"
    runs = gpu_suite.gpu_test_targets(["rest:1/3", "rest:2/3", "rest:3/3"])
    assert [t for run in runs for t in run if not t.startswith("--")] == files
    assert all(run[-2:] == [f"--deselect={t}" for t in gpu_suite._SWITCH_TESTS] for run in runs)
    assert all(len(run) > 2 for run in runs)
    parts = gpu_suite.gpu_test_targets(gpu_suite.GPU_TEST_PARTS)
    assert parts[0] == gpu_suite._SWITCH_TESTS and parts[1][0] == "tests/test_fuse.py" and parts[2] == whole
    node = "tests/engine/test_graph_widths.py::test_graphs_of_both_widths_give_the_eager_tokens[16]"
    assert gpu_suite.gpu_test_targets(["tests/ops/test_gemv.py", node]) == [
        ["tests/ops/test_gemv.py"],
        [node],
    ]
    for bad in ("rest:0/2", "rest:3/2", "rest:2", "switches:1/2", "ops", "tests/ops/test_nothing.py"):
        with pytest.raises(ValueError, match="gpu tests part"):
            gpu_suite.gpu_test_targets([bad])


def test_gpu_tests_log_parser_reads_a_cut_log(gpu_suite):
    """gpu_tests reads outcomes from pytest -v lines, so a log cut off mid-run (the call's time ran out) still
    names every test that ended; the last word wins (passed, then failed in teardown: an error)."""
    log = """============================= test session starts ==============================
tests/ops/test_kda.py::test_fla_chunk_gradients_match_the_reference[True-False] PASSED [  5%]
tests/ops/test_kda.py::test_fla_chunk_gradients_match_the_reference[False-True] FAILED [ 10%]
tests/test_fuse.py::test_compiled_training_step_equals_eager[cuda] PASSED [ 15%]
tests/test_fuse.py::test_compiled_training_step_equals_eager[cuda] ERROR [ 15%]
tests/ops/test_packed_conv.py::test_fla_conv_matches_reference[dtype0-False] SKIPPED (needs CUDA) [ 20%]
tests/ops/test_moe.py::test_grouped"""
    assert gpu_suite._pytest_outcomes(log) == {
        "tests/ops/test_kda.py::test_fla_chunk_gradients_match_the_reference[True-False]": "PASSED",
        "tests/ops/test_kda.py::test_fla_chunk_gradients_match_the_reference[False-True]": "FAILED",
        "tests/test_fuse.py::test_compiled_training_step_equals_eager[cuda]": "ERROR",
        "tests/ops/test_packed_conv.py::test_fla_conv_matches_reference[dtype0-False]": "SKIPPED",
    }


def test_gpu_tests_log_parser_reads_xdist_workers_lines(gpu_suite):
    """With --gpu-tests-workers, pytest-xdist writes `[gwK] [ n%] OUTCOME <node id>` as each test ends (the
    node id alone, without an outcome, as it starts; a crashed worker's test FAILED)."""
    log = """created: 8/8 workers
tests/ops/test_gemv.py::test_a[1]
[gw3] [  1%] PASSED tests/ops/test_gemv.py::test_a[1]
[gw0] [ 12%] SKIPPED tests/ops/test_moe.py::test_b[fp64]
[gw7] [100%] FAILED tests/ops/test_mla.py::test_c
[gw1] [ 99%] ERROR tests/ops/test_mla.py::test_d
FAILED tests/ops/test_mla.py::test_c - AssertionError"""
    assert gpu_suite._pytest_outcomes(log) == {
        "tests/ops/test_gemv.py::test_a[1]": "PASSED",
        "tests/ops/test_moe.py::test_b[fp64]": "SKIPPED",
        "tests/ops/test_mla.py::test_c": "FAILED",
        "tests/ops/test_mla.py::test_d": "ERROR",
    }


def test_xdist_args(gpu_suite, monkeypatch):
    """One worker: no xdist arguments. Several: `-n N` and worksteal from pytest-xdist 3.2 on (load before);
    without pytest-xdist, none, and the log says the part runs in one process."""
    import io
    import types

    assert gpu_suite.xdist_args(1) == []
    for version, dist in (("3.8.0", "worksteal"), ("3.2.1", "worksteal"), ("3.1.0", "load"), ("2.5", "load")):
        monkeypatch.setitem(sys.modules, "xdist", types.SimpleNamespace(__version__=version))
        assert gpu_suite.xdist_args(8) == ["-n", "8", "--dist", dist]
    monkeypatch.setitem(sys.modules, "xdist", None)  # import xdist raises ImportError
    log = io.StringIO()
    assert gpu_suite.xdist_args(8, log) == []
    assert "pytest-xdist is not installed" in log.getvalue()


def test_engine_test_files_run_alone_beside_workers(gpu_suite):
    """With several workers, the GPU-test files that build an Engine (each takes most of the GPU's free memory)
    run in a second pytest of one process; every such file among the targets is listed."""
    parts = gpu_suite.gpu_test_targets(["switches", "fuse", "rest"])
    files = {a.split("::")[0] for targets in parts for a in targets if a.startswith("tests/")}
    builds = {f for f in files if re.search(r"\b(Engine|_engine|LLM)\(", (ROOT / f).read_text())}
    assert builds == set(gpu_suite._ENGINE_TEST_FILES) & files == set(gpu_suite._ENGINE_TEST_FILES)

    rest = parts[2]
    assert gpu_suite.worker_runs(rest, 1) == [(rest, 1)]
    (shared, n), (alone, one) = gpu_suite.worker_runs(rest, 8)
    assert (n, one) == (8, 1)
    assert sorted(a for a in alone if a.startswith("tests/")) == sorted(gpu_suite._ENGINE_TEST_FILES)
    assert not set(alone) & set(shared) - {a for a in rest if not a.startswith("tests/")}
    assert sorted(set(shared) | set(alone)) == sorted(set(rest))
    deselect = [a for a in rest if a.startswith("--deselect")]
    assert deselect and all(d in shared and d in alone for d in deselect)
    # a part without an Engine file stays one run; fuse's -m gpu goes with its file
    assert gpu_suite.worker_runs(parts[1], 8) == [(parts[1], 8)]


def test_every_cuda_only_test_is_a_gpu_test(gpu_suite):
    """Every test file with cases that run on CUDA alone (marked gpu, or skipped where CUDA is not available) is
    in a part of the GPU tests: a CUDA case outside them would never run anywhere (CI has no GPU)."""
    cuda_only = re.compile(r"mark\.gpu\b|requires_cuda\b|skipif\(\s*not torch\.cuda\.is_available\(\)")
    found = {
        str(f.relative_to(ROOT))
        for f in (ROOT / "tests").rglob("test_*.py")
        if cuda_only.search(f.read_text()) and f.name != Path(__file__).name  # (this file: the pattern)
    }
    parts = gpu_suite.gpu_test_targets(gpu_suite.GPU_TEST_PARTS)
    covered = {a.split("::")[0] for targets in parts for a in targets if a.startswith("tests/")}
    assert "tests/models/test_training_path.py" in found  # (its skipif spans two lines)
    assert found - covered == set()
