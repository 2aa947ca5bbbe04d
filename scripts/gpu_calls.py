"""A session's device calls, committed: named jobs run in order inside one call's time, each skipped when less time
is left than its estimate; every log and JSON goes into one tarball under $OUT (a call returns at most 8 files) and
the figures that matter are printed at the end (a call's reply shows the last 12,000 characters of its output).

    python3 scripts/gpu_calls.py [--label a] [--budget 560] [--workers 8] [--commit C] JOB...   # on the device
    python3 scripts/gpu_calls.py --dry-run JOB...   # here: every command's options checked against its --help
    python3 scripts/gpu_calls.py --list

On the device (carry .whl, from scripts/fetch_wheels.sh) the script installs the wheels into /tmp/site, restores the
Triton cache (scripts/triton_cache.sh) and runs each command with PYTHONPATH=/tmp/site:<repo>. What comes back:
$OUT/<label>.tgz (every command's log and JSON, and calls.json) and $OUT/calls_<label>.json (what ran, its exit
status and seconds, the figures printed). `summarize` prints the figures of returned files again:

    python3 scripts/gpu_calls.py --summarize DIR_OR_TGZ...

The jobs that close issue 4 (every GPU test and every figure at one commit, with the batch-1 account), in three
calls issued back to back (a machine is given back 30 s after a call; a cold start costs about 2 minutes):
    1. served topk tests                 2. decode prefill kernels served:--cuda-graph-short-len=0
    3. l2 moe short
Session 56 (H100) timed the rows GEMV (call a) and made it the default up to 2 rows; session 57 (H100) repeated
it (call b: `served served:KESTREL_GEMV_FUSE=gate gemvab:8 moe rows tests:...`) and made the gate inside it at one
row and the MoE's router_early the defaults, then checked their tokens (call c: `served tests:... decode`; decode had
no time left). Session 58 (H100) checked and swept the CUDA top-k's register variants and timed them in the step
(call e: `topk:cases,rows_sweep tests:tests/ops/test_dsa_cuda_topk.py served ab:KESTREL_DSA_TOPK_REGISTERS=auto/off:1
decode`). Session 59 (H100) ran what waited, call f: `tests:tests/ops/test_dsa_cuda_topk.py,
tests/engine/test_dsa_topk_rows.py,tests/ops/test_moe_decode_triton.py,tests/ops/test_gemv.py
served:KESTREL_DSA_TOPK_ROWS=on ab:KESTREL_DSA_TOPK_ROWS=off/on:2 decode` (the pool rows: the same tokens, slower,
off), then `tests` (g) and the files g did not reach (h), on the machine f had left warm. Session 60 (H100, asked as
nvidia-h200) ran `served moe decode tests:...` (i; test_engine.py ran the tiny model on the CPU until the budget
ran out: leave it to the CPU suite), `tests:tests/ops/test_moe_decode_triton.py,tests/models/test_training_path.py`
(j), `prefill kernels` (k), `topk:cases,timing tests:switches,fuse` (l) and `moe` (m) on one warm machine; later
`moe tests:tests/ops/test_moe_decode_triton.py` (n) and `moe` (o) timed TILES' router_rows (slower; dropped). Session
61 (H100, each asked as nvidia-h200 with the closing calls in the command should an H200 come) timed the CUDA chain
(kestrel.ops.linear.cuda_chain): `tests:tests/ops/test_cuda_chain.py l2` (q-x, A), and ran Nsight Compute on it
(scripts/cuda_chain_ncu.py's docstring has the command). Session 62's fifteen asks finished no call: its chain
changes (the LL input as bf16 units; `mma`, the sums on the tensor cores) and session 63's (twenty-two asks, no call:
a review's three mends; `mma_lanes`) were timed by session 64 (H100) with its own (`mma_packed`, the in-flight cap,
`mma_parts`) in `l2 tests:tests/ops/test_cuda_chain.py` (a-c, about 80 s of work) and `cuda_chain_ncu.py packed4`
under ncu (c). Session 65 timed the chain's trace and poll_sleep with `l2 tests:tests/ops/test_cuda_chain.py` (a on
an H100, b on an H200, 61-77 s of work each; carry `.whl` alone: with `.whl-train` beside the tree a call passes its
64 MiB). Session 66 timed the mended trace, `test_wait` and `mma_fold` with the same command (a, H100, 74 s of work,
asked as nvidia-h100-x1). Session 67 (H100) ran the same command at its commit and a9d7102's `l2` beside it from
an archive of that commit carried as .session/a9d (`cd .session/a9d && python3 scripts/gpu_calls.py --no-setup
--label old --budget 200 l2`), and Nsight Compute's source page on `cuda_chain_ncu.py` alone/best (b, b2, c; its
docstring has the commands; the reports tarred under $OUT). Session 68 (H100) did the same at 6d5372b with a9d7102
beside it (d), then at a5f2ec3 with 6d5372b beside it (e; .session/d68, `--label prev`). Session 69's
twenty-three asks (05:33-07:18 UTC) started one machine, taken back before the call finished, and no other: its
call f, `--commit <C> l2 tests:tests/ops/test_cuda_chain.py` with a5f2ec3's `l2` beside it (.session/prev, `--label
prev`), ran in session 70 (H100, f; 62 s with the Nsight Compute run on `best_pipe`; a5f2ec3's `l2` in a second
call on the machine f left warm: `--budget 110` had skipped it, its estimate being 120 s), then `served tests` (g,
cut at 486 s in the Engine-building files) and `tests:<g's 3 failures and those files>` (h, 338 s). Session 71
(H100) ran `tests:tests/engine/test_prompt_logprobs.py served` (a), then, after eleven asks that got no machine,
`served tests:tests/engine/test_sampler.py,tests/engine/test_prompt_logprobs.py,tests/engine/test_overlap.py` (b)
and `tests:tests/engine/test_hicache.py` (c): give `--commit`, since the device copy's git metadata may stay at the
session's first tree (b's record reads 21efcfb for c60733c's files). Next, when an
H200 comes for a whole session's budget: the three calls above at one commit (the H200's step figures are session
52's; every H100 figure since is not comparable with them).
The tests take what the call has left: where they are cut, the next call runs the parts not reached
(tests:rest:2/2 and so on; the summary counts the outcomes so far from pytest's log).
Each job's help (`--list`) says what it runs."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLI = [PY, "-m", "kestrel.serve.cli"]


@dataclasses.dataclass
class Run:
    """One command of a job: its log is <results>/<tag>.log; `json` is the file it writes (relative to the results
    folder), which `show` turns into the lines printed."""

    tag: str
    argv: list[str]
    est_s: int  # skipped when less than this is left of the call's budget
    json: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    show: Callable[[dict], list[str]] | None = None
    cut: Callable[[Path], list[str]] | None = None  # what a run cut before its JSON left (the results folder)


# ---- what each result holds, in a few lines --------------------------------------------------------------------


def show_decode(d: dict) -> list[str]:
    """`bench decode`: every point's step, replay and MBU; the launches against the bytes; 128K over 4K."""
    lines = [f"copy {d['ceilings']['copy_TBps']:.3f} TB/s"]
    for r in d["runs"]:
        line = (
            f"b={r['batch']:<3} ctx={r['context']:<6} {r['attention']:9} max {r.get('max_model_len')} graph "
            f"{r.get('graph_width')}: step {r['step_ms']:.3f} ms (replay {r['graph_replay_ms'] or float('nan'):.3f})"
            f" MBU {r['mbu']:.1%} ({(r['mbu_graph_replay'] or 0):.1%})"
        )
        if "profile" in r:
            line += f", {r['profile']['kernels_per_step']:.0f} kernels"
        if "launch_floor" in r:
            line += f", launches {r['launch_floor']['launches_ms']:.3f} ms"
        if "grammar_new_states" in r:
            new = r["grammar_new_states"]
            line += f", no overlap {r['step_ms_no_overlap']:.3f} ms"
            line += f"; new grammar states {new['overlap']}/{new['no_overlap']}"
        if r.get("moe_barrier_gave_up"):
            line += ", MoE BARRIER GAVE UP"
        lines.append(line)
        if "host_profile" in r:  # Engine.step() under cProfile: the host's five costliest functions a step
            host = r["host_profile"]
            lines.append(
                f"  host {host['wall_ms_per_step']:.3f} ms a step (cProfile): "
                + "; ".join(
                    f"{f['function'][:48]} {f['own_ms_per_step']:.3f}" for f in host["by_own_time"][:5]
                )
            )
    step = {
        (r["batch"], r["context"], r["attention"], r.get("max_model_len")): r["step_ms"] for r in d["runs"]
    }
    for (b, ctx, attention, _), ms in step.items():
        base = [v for (b2, c2, a2, _), v in step.items() if (b2, a2) == (b, attention) and c2 == 4096]
        if ctx > 4096 and base:
            lines.append(f"b={b} {attention}: ctx {ctx} / 4096 = {ms / base[0]:.2f}x")
    for e in d.get("engines", []):
        lines.append(
            f"engine max {e['max_model_len']}: {e['setup_s']:.1f} s, graphs {e['decode_graphs']}, "
            f"{e.get('graph_gib', 0):.2f} GiB"
        )
    return lines


def show_gpu_tests(d: dict) -> list[str]:
    t = d["sections"]["gpu_tests"]
    if "error" in t:
        return [f"error {t['error']}"]
    return [f"returncodes {t['returncodes']}, {t['counts']}", *(f"FAILED {name}" for name in t["failed"])]


def cut_gpu_tests(results: Path) -> list[str]:
    """The GPU tests cut by the budget (no JSON yet): the outcomes pytest wrote into their log, one line a test."""
    log = results / "tests" / "gpu_tests.log"
    if not log.is_file():
        return ["(cut before any test ended)"]
    suite = _gpu_suite()
    counts, failed = suite.outcome_counts(suite._pytest_outcomes(log.read_text(errors="replace")))
    return [f"cut: {counts} so far", *(f"FAILED {name}" for name in failed)]


def _gpu_suite():
    """scripts/gpu_suite.py as a module (its log parser; it imports torch)."""
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "scripts" / "gpu_suite.py")
    module = sys.modules.setdefault(
        "gpu_suite", importlib.util.module_from_spec(spec)
    )  # (its dataclasses look)
    spec.loader.exec_module(module)
    return module


def show_topk(d: dict) -> list[str]:
    """topk_cuda_check: the 64 x 131072 timing against torch.topk, the correctness cases (any variant unlike the
    reference, or an error), and decode's short rows (rows_sweep) by variant, us."""
    lines = []
    if "timing" in d:
        t = d["timing"]["randn"]
        ours, peer = t["topk_cuda"]["cold_us"], t["torch_topk"]["cold_us"]
        lines.append(
            f"{d['timing']['shape']} k={d['timing']['k']}: topk_cuda {ours:.1f} us, torch.topk {peer:.1f} us: "
            f"{peer / ours:.2f}x"
        )

    def wrong(case: dict) -> bool:
        return "error" in case or any(
            v is False for k, v in case.items() if k.startswith("equal") or k.startswith("naive_ok")
        )

    if "cases" in d:
        bad = [c.get("case", "?") for c in d["cases"] if wrong(c)]
        lines.append(f"{len(d['cases'])} cases, {len(bad)} with a set unlike the reference's {bad[:4]}")
    for name, entry in d.get("rows_sweep", {}).items():
        if not isinstance(entry, dict) or name.split("x")[0] not in ("1", "4", "256") or "131072" in name:
            continue
        times = " ".join(
            f"{k} {v['cold_us']:.1f}" + ("" if v.get("equal_naive", True) else "!")
            for k, v in entry.items()
            if isinstance(v, dict) and "cold_us" in v
        )
        lines.append(f"rows {name} (auto v{entry.get('auto_picks')}): {times}")
    return lines


def show_prefill(d: dict) -> list[str]:
    cases = d["sections"]["prefill_bench"]
    if "error" in cases:
        return [f"error {cases['error']}"]
    cases = cases.get("cases", cases)
    return [
        f"{name}: {c['step_s'] * 1e3:.1f} ms, MFU {c['mfu_of_measured_matmul']:.1%}"
        for name, c in cases.items()
        if isinstance(c, dict) and "step_s" in c
    ]


def show_kernels(d: dict) -> list[str]:
    lines = [
        f"copy {d['ceilings']['copy_TBps']:.2f} TB/s, matmul {d['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    ]
    for k in d["kernels"]:
        peer = f", {k['peer']} {k['peer_ms']:.3f} ms" if k.get("peer_ms") else ""
        lines.append(
            f"{k['kernel']}: {k['ms']:.3f} ms, {k['bandwidth_of_copy']:.0%} of copy, "
            f"{k['flops_of_matmul']:.0%} of matmul{peer}"
        )
    return lines


def show_served(d: dict) -> list[str]:
    gave_up = ", MoE BARRIER GAVE UP" if d.get("moe_barrier_gave_up") else ""
    return [
        f"{d['same']} of {d['prompts']} prompts gave the reference's tokens ({d['seconds']:.1f} s){gave_up}"
    ]


def show_kernels_check(d: dict) -> list[str]:
    """decode_kernels_check: the sections this script runs (moe_fused, l2_ahead, pdl)."""
    lines = [f"{name} failed: {err.strip().splitlines()[-1]}" for name, err in d.get("errors", {}).items()]
    if m := d.get("moe_fused"):
        best = m.get("best") or {}
        lines.append(
            f"moe_fused: floor {m['floor_us']:.1f} us, six launches {m['six_launches_us']:.1f}, best "
            f"{best.get('us', float('nan')):.1f}, best hot {m.get('best_hot_us', float('nan')):.1f}"
        )
    if a := d.get("l2_ahead"):
        lines.append(
            "l2_ahead us a layer: "
            + ", ".join(
                f"{k[: -len('_us_a_layer')]} {v:.2f}" for k, v in a.items() if k.endswith("_us_a_layer")
            )
        )
        if best := a.get("persistent_best"):
            knobs = ", ".join(
                f"{k} {best[k]}" for k in ("block_n", "ahead", "programs", "num_warps") if k in best
            )
            lines.append(f"l2_ahead persistent best: {best['us_a_layer']:.2f} us a layer ({knobs})")
        lines += _cuda_chain_lines(a.get("cuda_chain") or [])
    if g := d.get("gemv_rows"):
        lines.append(
            f"gemv_rows floors us a layer: chain {g['chain_floor_us_a_layer']:.2f}, merged "
            f"{g['merged_floor_us_a_layer']:.2f}"
        )
        for r in g["runs"]:
            knobs = (
                "dot"
                if r.get("kernel") == "dot"
                else "rows, default tile"
                if "rows_block_n" not in r
                else f"rows bn {r.get('rows_block_n')} w {r.get('rows_warps')} early {r.get('early')}"
                + (f" programs {r['rows_programs']}" if r.get("rows_programs") else "")
            )
            if "error" in r:
                lines.append(f"  b={r['batch']} {knobs}: {r['error'][:120]}")
                continue
            hot = f" (hot {r['chain_hot_us_a_layer']:.2f})" if "chain_hot_us_a_layer" in r else ""
            lines.append(
                f"  b={r['batch']} {knobs}: chain {r['chain_us_a_layer']:.2f}{hot}, merged "
                f"{r['merged_us_a_layer']:.2f}; err {r['chain_rel_err']:.1e} / {r['merged_rel_err']:.1e}"
            )
    if p := d.get("pdl"):
        lines += [
            f"pdl b={b}: {v['auto_us_per_kernel']:.3f} us a kernel (off {v['off_us_per_kernel']:.3f})"
            for b, v in p["batches"].items()
        ]
    return lines


# ---- the jobs ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Call:
    """What every job's commands share: pytest-xdist workers for the tests, the folder the results go to."""

    workers: int = 8  # the device machine has 16 cores; the Engine-building test files run alone after
    results: Path = Path("/tmp/gpu_calls")

    def out(self, name: str) -> str:
        return str(self.results / name)


def _script(name: str) -> str:
    return str(ROOT / "scripts" / name)


def _decode(call: Call, tag: str, est: int, *options: str, env: dict | None = None) -> Run:
    argv = [*CLI, "bench", "decode", *options, "--out", call.out(f"{tag}.json")]
    return Run(tag, argv, est, f"{tag}.json", env or {}, show_decode)


def _check(call: Call, tag: str, sections: str, est: int) -> Run:
    argv = [PY, _script("decode_kernels_check.py"), "--sections", sections, "--out", call.out(f"{tag}.json")]
    return Run(tag, argv, est, f"{tag}.json", show=show_kernels_check)


def job_tests(arg: str | None, call: Call) -> list[Run]:
    """`tests[:PARTS]`: the suite's groups (240 s at least), or test files named by path (60 s at least: one
    file took 28-150 s in sessions 57-58)."""
    parts = arg or "switches,fuse,rest"
    argv = [PY, _script("gpu_suite.py"), "--sections", "gpu_tests", "--gpu-tests-parts", parts]
    argv += ["--gpu-tests-workers", str(call.workers), "--out", call.out("tests")]
    files = all(part.endswith(".py") for part in parts.split(","))
    return [
        Run(
            "tests",
            argv,
            60 if files else 240,
            "tests/gpu_suite.json",
            show=show_gpu_tests,
            cut=cut_gpu_tests,
        )
    ]


def job_served(arg: str | None, call: Call) -> list[Run]:
    """`served:VAR=VAL,--option=VAL,...`: variables for the run's environment, options for served_tokens.py."""
    pairs = [pair.split("=", 1) for pair in arg.split(",")] if arg else []
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"served:{arg}: want NAME=VALUE pairs, comma-separated")
    env = {k: v for k, v in pairs if not k.startswith("--")}
    options = [f"{k}={v}" for k, v in pairs if k.startswith("--")]
    tag = "served" + "".join(
        f"_{k.removeprefix('KESTREL_').strip('-')}_{v}" for k, v in pairs
    ).lower().replace("-", "_")
    argv = [PY, _script("served_tokens.py"), *options, "--out", call.out(f"{tag}.json")]
    return [Run(tag, argv, 45, f"{tag}.json", env, show_served)]


def job_decode(arg: str | None, call: Call) -> list[Run]:
    return [_decode(call, "decode", 110, "--batches", "1,256", "--contexts", "4096,131072", "--profile")]


def job_topk(arg: str | None, call: Call) -> list[Run]:
    """`topk[:SECTIONS]`: topk_cuda_check.py, every section or those named (comma-separated, as its --sections)."""
    argv = [PY, _script("topk_cuda_check.py"), "--out", call.out("topk.json")]
    argv += ["--sections", arg] if arg else []
    return [Run("topk", argv, 60, "topk.json", show=show_topk)]


def job_prefill(arg: str | None, call: Call) -> list[Run]:
    argv = [PY, _script("gpu_suite.py"), "--sections", "prefill_bench", "--out", call.out("prefill")]
    return [Run("prefill", argv, 120, "prefill/gpu_suite.json", show=show_prefill)]


def job_kernels(arg: str | None, call: Call) -> list[Run]:
    argv = [*CLI, "bench", "kernels", "--out", call.out("kernels.json")]
    return [Run("kernels", argv, 150, "kernels.json", show=show_kernels)]


def _count(arg: str | None, job: str) -> int:
    """A job's number of runs: `job:N` (1 to 4; 4 without it), for a call too short for all four."""
    if arg is None:
        return 4
    if not arg.isdigit() or not 1 <= int(arg) <= 4:
        raise ValueError(f"{job}:N takes a number of runs from 1 to 4, not {arg!r}")
    return int(arg)


def job_short(arg: str | None, call: Call) -> list[Run]:
    """4K contexts on an engine of serve's default limit (131072), with and without short decode graphs of 8192
    tokens, alternating; dense MLA in the first pair. `short:N` runs the first N."""
    runs = []
    for i, short in enumerate((8192, 0, 8192, 0)[: _count(arg, "short")]):
        dense = [] if i < 2 else ["--no-dense"]
        options = ["--batches", "1,64,256", "--contexts", "4096", "--max-model-len", "131072"]
        runs.append(
            _decode(
                call, f"short{short}_{i // 2}", 90, *options, "--cuda-graph-short-len", str(short), *dense
            )
        )
    return runs


GEMV_MODES = (  # gemvab's runs, in order: the K loop throughout, the rows kernel alone, with the gates, with all
    ("dot", {"KESTREL_GEMV": "dot", "KESTREL_GEMV_FUSE": "none"}),
    ("auto", {"KESTREL_GEMV": "auto", "KESTREL_GEMV_FUSE": "none"}),
    ("gate", {"KESTREL_GEMV": "auto", "KESTREL_GEMV_FUSE": "gate"}),
    ("all", {"KESTREL_GEMV": "auto", "KESTREL_GEMV_FUSE": "all"}),
)
GEMV_ROUNDS = 3


def job_gemvab(arg: str | None, call: Call) -> list[Run]:
    """bench decode at 4K, batch 1, 2, 4 and 16, DSA only, with the GEMV's K-loop kernel for every row count
    (KESTREL_GEMV=dot), with the rows kernel up to ROWS_AUTO_M rows and nothing inside it (auto, fuse none), with
    the output gates inside it (KESTREL_GEMV_FUSE=gate; the default since session 57 takes them at one row only),
    and with the conv step too (all), in turn. `gemvab:N` runs the first N of
    GEMV_ROUNDS rounds (one round without)."""
    modes = len(GEMV_MODES)
    most = GEMV_ROUNDS * modes
    n = modes if arg is None else int(arg) if arg.isdigit() and 1 <= int(arg) <= most else None
    if n is None:
        raise ValueError(f"gemvab:N takes a number of runs from 1 to {most}, not {arg!r}")
    runs = []
    for i, (mode, env) in enumerate((GEMV_MODES * GEMV_ROUNDS)[:n]):
        options = ["--batches", "1,2,4,16", "--contexts", "4096", "--no-dense"]
        runs.append(_decode(call, f"gemv_{mode}_{i // modes}", 70, *options, env=env))
    return runs


def job_ab(arg: str | None, call: Call) -> list[Run]:
    """`ab:VAR=A/B[:N]`: bench decode at 4K, batch 1, 4, 16 and 256, DSA only, with the environment variable VAR
    at A, then at B, alternating for N rounds (2 without it; 1 to 4), so that a switch is timed against the code
    without it on one machine in one call."""
    spec, _, rounds = (arg or "").rpartition(":")
    if not rounds.isdigit():  # no round count given
        spec, rounds = arg or "", "2"
    name, eq, values = spec.partition("=")
    pair = values.split("/")
    if not eq or not name or len(pair) != 2 or not all(pair) or not 1 <= int(rounds) <= 4:
        raise ValueError(f"ab:{arg}: want VAR=A/B or VAR=A/B:N (N rounds, 1 to 4)")
    runs = []
    for i in range(int(rounds)):
        for value in pair:
            options = ["--batches", "1,4,16,256", "--contexts", "4096", "--no-dense"]
            tag = f"ab_{name.removeprefix('KESTREL_').lower()}_{value}_{i}"
            runs.append(_decode(call, tag, 80, *options, env={name: value}))
    return runs


SAMPLING_MODES = ("greedy", "logprobs", "penalties", "steer", "grammar")  # bench decode's --sampling


def job_sampling(arg: str | None, call: Call) -> list[Run]:
    """`sampling[:MODES]`: bench decode at 4K, batch 1 and 256, DSA only, with each --sampling mode in turn
    (greedy first, named or not: the others' peer in the same call); MODES comma-separated, all four without it.
    Profiled (--profile): the replay's kernels, and Engine.step()'s host time by function, where a mode's extra
    time a step goes."""
    modes = arg.split(",") if arg else list(SAMPLING_MODES)
    if not set(modes) <= set(SAMPLING_MODES):
        raise ValueError(f"sampling:{arg}: modes are {', '.join(SAMPLING_MODES)}")
    modes = ["greedy", *(m for m in dict.fromkeys(modes) if m != "greedy")]
    options = ["--batches", "1,256", "--contexts", "4096", "--no-dense", "--profile"]
    return [_decode(call, f"sampling_{mode}", 75, *options, "--sampling", mode) for mode in modes]


JOBS: dict[str, tuple[str, Callable[[str | None, Call], list[Run]]]] = {
    "tests": (
        "tests[:PARTS]: gpu_suite's GPU tests (PARTS as --gpu-tests-parts; --workers processes)",
        job_tests,
    ),
    "served": (
        "served[:VAR=VAL,--option=VAL,...]: the shipped model's greedy tokens against session 39's",
        job_served,
    ),
    "decode": (
        "decode: bench decode at batch 1 and 256, 4K and 128K, DSA and dense MLA, profiled",
        job_decode,
    ),
    "topk": (
        "topk[:SECTIONS]: scripts/topk_cuda_check.py (top-2048 of 64 x 131072 against torch.topk; every variant on "
        "the correctness cases; decode's rows swept)",
        job_topk,
    ),
    "prefill": ("prefill: gpu_suite's prefill_bench (packed 8 x 4096 and 1 x 32768: MFU)", job_prefill),
    "kernels": (
        "kernels: kestrel bench kernels (each kernel against the ceilings and its torch peer)",
        job_kernels,
    ),
    "short": (
        "short[:N]: bench decode at 4K on a 131072-token engine, short graphs of 8192 on and off (N runs of 4)",
        job_short,
    ),
    "moe": (
        "moe: decode_kernels_check moe_fused (the one-launch MoE; best_hot_us: its weights in L2)",
        lambda arg, call: [_check(call, "moe", "moe_fused", 90)],
    ),
    "l2": (
        "l2: decode_kernels_check l2_ahead (batch 1's projections, weights cold and hot in L2, and as one persistent "
        "launch that asks L2 for the stages ahead, swept)",
        lambda arg, call: [_check(call, "l2", "l2_ahead", 120)],
    ),
    "rows": (
        "rows: decode_kernels_check gemv_rows (the GEMV's rows kernel against its K-loop kernel at batch 1-4, swept)",
        lambda arg, call: [_check(call, "rows", "gemv_rows", 90)],
    ),
    "gemvab": (
        "gemvab[:N]: bench decode at 4K, batch 1/2/4/16: KESTREL_GEMV dot, auto, auto + fused gate, + all (N of 12)",
        job_gemvab,
    ),
    "ab": ("ab:VAR=A/B[:N]: bench decode at 4K, batch 1/4/16/256, VAR=A then VAR=B, N rounds (2)", job_ab),
    "sampling": (
        "sampling[:MODES]: bench decode at 4K, batch 1/256, --sampling greedy, logprobs, penalties, steer, grammar",
        job_sampling,
    ),
    "pdl": (
        "pdl: decode_kernels_check pdl (the launch floor with and without PDL)",
        lambda arg, call: [_check(call, "pdl", "pdl", 30)],
    ),
}


def plan(jobs: list[str], call: Call = Call()) -> list[Run]:
    """The runs of `jobs` (NAME or NAME:ARG), in order; an unknown name raises ValueError."""
    runs = []
    for job in jobs:
        name, _, arg = job.partition(":")
        if name not in JOBS:
            raise ValueError(f"unknown job {job!r}: choose from {', '.join(JOBS)}")
        runs += JOBS[name][1](arg or None, call)
    tags = [r.tag for r in runs]
    if len(set(tags)) != len(tags):
        raise ValueError(f"a job is named twice: {tags}")
    return runs


# ---- running them --------------------------------------------------------------------------------------------------


def dry_run(runs: list[Run]) -> list[str]:
    """Problems with the runs' commands, checked here without a GPU: the script exists, and every --option it is
    given is one its --help lists (a typo would cost a device call)."""
    problems, helps = [], {}
    for run in runs:
        words = run.argv[1:]
        head = words[:2] if words[0] == "-m" else words[:1]
        rest = words[len(head) :]
        while rest and not rest[0].startswith("-"):  # subcommands: kestrel bench decode
            head, rest = head + rest[:1], rest[1:]
        if head[0] != "-m" and not (ROOT / head[0]).is_file():
            problems.append(f"{run.tag}: no file {head[0]}")
            continue
        key = tuple(head)
        if key not in helps:
            out = subprocess.run([PY, *head, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
            helps[key] = out.stdout if out.returncode == 0 else None
            if helps[key] is None:
                problems.append(f"{run.tag}: {' '.join(head)} --help failed: {out.stderr.strip()[-300:]}")
        for option in (w.split("=")[0] for w in rest if w.startswith("--")):
            if helps[key] is not None and not re.search(rf"{re.escape(option)}\b", helps[key]):
                problems.append(f"{run.tag}: {' '.join(head)} takes no {option}")
    return problems


def _setup(log) -> dict[str, str]:
    """The device machine's environment: the carried wheels installed, the Triton cache restored."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
        TRITON_CACHE_DIR="/tmp/tc",
        TRITON_CACHE_AUTOTUNING="1",
    )
    wheels = sorted(str(w) for w in (ROOT / ".whl").glob("*.whl"))
    if wheels:
        pip = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
        subprocess.run(
            [*pip, "--upgrade", "--target", "/tmp/site", *wheels], stdout=log, stderr=subprocess.STDOUT
        )
        env["PYTHONPATH"] = f"/tmp/site:{ROOT}"
    else:
        env["PYTHONPATH"] = str(ROOT)
    subprocess.run(["bash", "scripts/triton_cache.sh", "restore"], cwd=ROOT, env=env, stdout=log, stderr=log)
    return env


def _gpu_line() -> str:
    try:
        query = "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used"
        return subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout
    except OSError:
        return "no nvidia-smi"


def _commit(given: str | None) -> str:
    if given:
        return given
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown (no .git on the device: pass --commit)"


def shown(run: Run, results: Path) -> list[str]:
    """The lines `run.show` makes of its JSON; its log's last lines where there is no JSON."""
    path = results / run.json if run.json else None
    if path is not None and path.is_file() and run.show is not None:
        try:
            return run.show(json.loads(path.read_text()))
        except Exception as e:  # noqa: BLE001 - a summary must not lose the other runs'
            return [f"(its JSON could not be summarized: {e!r})"]
    if run.cut is not None:
        return run.cut(results)
    log = results / f"{run.tag}.log"
    return (
        [f"(no JSON) {line}" for line in log.read_text(errors="replace").splitlines()[-6:]]
        if log.is_file()
        else []
    )


def execute(runs: list[Run], args) -> dict:
    started = time.monotonic()
    results = Path(args.results)
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    with (results / "setup.log").open("w") as log:
        env = _setup(log) if args.setup else dict(os.environ, PYTHONPATH=str(ROOT))
    record = {
        "label": args.label,
        "commit": _commit(args.commit),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": _gpu_line().strip(),
        "jobs": args.jobs,
        "budget_s": args.budget,
        "runs": [],
    }
    print(f"{record['date']} {record['commit']} {record['gpu']}", flush=True)
    for run in runs:
        left = args.budget - (time.monotonic() - started)
        entry = {"tag": run.tag, "command": " ".join(run.argv), "env": run.env}
        record["runs"].append(entry)
        if left < run.est_s:
            entry["skipped"] = f"{left:.0f} s left, estimate {run.est_s} s"
            print(f"== {run.tag} skipped: {entry['skipped']}", flush=True)
            continue
        t = time.monotonic()
        with (results / f"{run.tag}.log").open("w") as log:
            proc = subprocess.Popen(
                run.argv,
                cwd=ROOT,
                env=dict(env, **run.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                entry["returncode"] = proc.wait(timeout=max(left - 5, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its children too (pytest's workers)
                proc.wait()
                entry["returncode"] = "timed out"
        entry["wall_s"] = round(time.monotonic() - t, 1)
        entry["shown"] = shown(run, results)
        print(
            f"== {run.tag} rc {entry['returncode']} in {entry['wall_s']} s",
            *entry["shown"],
            sep="\n  ",
            flush=True,
        )
        (results / "calls.json").write_text(json.dumps(record, indent=1))
    record["wall_s"] = round(time.monotonic() - started, 1)
    (results / "calls.json").write_text(json.dumps(record, indent=1))
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(results / "calls.json", out / f"calls_{args.label}.json")
    with tarfile.open(out / f"{args.label}.tgz", "w:gz") as tar:
        tar.add(results, arcname=args.label)
    return record


def _cuda_chain_lines(rows: list[dict]) -> list[str]:
    """The CUDA chain's rows of `l2`: its best correct configuration, and each traced one's spans (medians, us)."""
    skip = ("blocks", "ring_bytes", "rel_err", "gave_up", "ok", "us_a_layer", "trace", "trace_file", "error")

    def knobs(row: dict) -> str:
        return ", ".join(k if v is True else f"{k} {v}" for k, v in row.items() if k not in skip)

    lines = []
    probes = ("no_barrier", "no_stream", "no_compute", "no_input")  # timing probes whose results are wrong
    correct = [r for r in rows if r.get("ok") and "us_a_layer" in r and not any(r.get(k) for k in probes)]
    if correct:
        best = min(correct, key=lambda r: r["us_a_layer"])
        lines.append(f"l2_ahead cuda chain best: {best['us_a_layer']:.2f} us a layer ({knobs(best)})")
    for row in rows:
        if t := row.get("trace"):
            spans = ", ".join(
                f"{k[: -len('_us')]} {v['median']:.2f}" for k, v in t.items() if k.endswith("_us")
            )
            lines.append(
                f"  traced {knobs(row)}: {row.get('us_a_layer', float('nan')):.2f} us a layer; {spans}"
            )
            for shape, c in t.get("by_class", {}).items():  # a stage shape's medians, on one time line
                spans = ", ".join(
                    f"{k} {v:.2f}/{c[f'critical_{k}']:.2f}" for k, v in c.items() if f"critical_{k}" in c
                )
                lines.append(
                    f"    {shape}: period {c['period']:.2f} (mean {c['period_mean']:.2f}, last input in "
                    f"{c['latency_max']:.2f}); a block / the last block: {spans}"
                )
    return lines


def summarize(paths: list[str]) -> list[dict]:
    """Print the figures of returned results again: each calls.json found (in a folder or a .tgz), re-read. Returns
    each call's record with every run's JSON result in it (`result`), for the session's record in bench/results."""
    found = []
    for path in map(Path, paths):
        with tempfile.TemporaryDirectory() as tmp:
            if path.suffix == ".tgz":
                with tarfile.open(path) as tar:
                    tar.extractall(tmp, filter="data")
                path = Path(tmp)
            for calls in sorted(path.rglob("calls.json")):
                record = json.loads(calls.read_text())
                print(f"# {record['label']} at {record['commit']}, {record['date']}: {record['gpu']}")
                runs = {r.tag: r for r in plan(record["jobs"])}
                for entry in record["runs"]:
                    status = entry.get("skipped") or f"rc {entry['returncode']} in {entry['wall_s']} s"
                    run = runs.get(entry["tag"])
                    print(
                        f"== {entry['tag']}: {status}", *(shown(run, calls.parent) if run else []), sep="\n  "
                    )
                    result = calls.parent / run.json if run and run.json else None
                    if result is not None and result.is_file():
                        entry["result"] = json.loads(result.read_text())
                found.append(record)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", nargs="*", help="NAME or NAME:ARG (--list)")
    parser.add_argument(
        "--label", default="a", help="the call's name: $OUT/<label>.tgz, $OUT/calls_<label>.json"
    )
    parser.add_argument(
        "--budget", type=int, default=560, help="seconds for the whole call (a run is 600 at most)"
    )
    parser.add_argument("--workers", type=int, default=8, help="tests: pytest-xdist processes on the one GPU")
    parser.add_argument(
        "--commit", default=None, help="recorded as the commit (the device's copy has no .git)"
    )
    parser.add_argument("--results", default="/tmp/gpu_calls", help="where the runs write, packed at the end")
    parser.add_argument(
        "--no-setup", dest="setup", action="store_false", help="no wheels installed, no Triton cache restored"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check every command's options here; run nothing"
    )
    parser.add_argument("--list", action="store_true", help="the jobs and what each runs")
    parser.add_argument(
        "--summarize", nargs="+", metavar="PATH", help="print the figures of returned results"
    )
    parser.add_argument(
        "--record", metavar="FILE", help="with --summarize: write the calls and every run's JSON into FILE"
    )
    args = parser.parse_args(argv)
    if args.list:
        print(*(help_ for help_, _ in JOBS.values()), sep="\n")
        return 0
    if args.summarize:
        found = summarize(args.summarize)
        if args.record:
            Path(args.record).write_text(json.dumps({"calls": found}, indent=1))
            print(f"wrote {args.record}: {len(found)} calls, every run's result in it")
        return 0
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.label):
        parser.error("--label: letters, digits, '.', '_' and '-' only (what the device returns)")
    if not args.jobs:
        parser.error("name at least one job (--list)")
    try:
        runs = plan(args.jobs, Call(args.workers, Path(args.results)))
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        for run in runs:
            print(
                f"{run.tag} (>= {run.est_s} s): {' '.join(f'{k}={v}' for k, v in run.env.items())} "
                f"{' '.join(run.argv[1:])}".replace("  ", " ")
            )
        problems = dry_run(runs)
        print(*problems or ["every command's options are its own"], sep="\n")
        return 1 if problems else 0
    record = execute(runs, args)
    failed = [r["tag"] for r in record["runs"] if r.get("returncode") not in (0, None)]
    print(f"done in {record['wall_s']} s; failed or cut: {failed or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
