"""The CUDA exact top-k on the device in one run: build, correctness, speed, CUDA graph; one JSON result.

    export PYTHONPATH=$PWD; python3 scripts/topk_cuda_check.py --out $OUT/topk_cuda.json
    python3 scripts/topk_cuda_check.py --sections cases,rows_sweep --out $OUT/topk_rows.json  # some sections

1. builds kestrel/ops/dsa/cuda_topk.cu (the build's seconds: nvcc's, or ~0 when the cache already had it);
2. runs each correctness case (`cases`) into poisoned outputs, every kernel variant of topk_cuda that takes the
   case's rows against naive.topk_select (listed by position; a short variant, 5-8, on rows wider than it takes
   is recorded as skipped) and, while time allows, topk_cuda's own pick against topk_triton (whose Triton
   compiles take most of this script's time on a fresh machine);
3. times (`timing`) [64, 131072] fp32 scores, k = 2048, full lens, for topk_cuda (each variant: `topk_cuda_v0`, ...;
   `topk_cuda` is its own pick, cuda_topk.choose_variant), topk_triton and torch.topk (dim=-1), with
   CUDA events, the median of 50 after 10 warm-ups, L2 flushed before each (`cold`, as kestrel.bench times
   kernels) and not (`warm`: the scores just written, as after the indexer kernel); score kinds randn, ramp
   (randn plus a rise to the row's end) and ties (integers 0-299: ~19 K keys in the threshold digit);
4. captures topk_cuda in a CUDA graph (`graph`), replays it on fresh inputs and compares with eager;
5. times the shapes prefill and sparse training give the top-k (`shapes`): mini's prefill of one 4096-token
   sequence ([4096, 4096], causal lens, k = 2048) and the demo model's training row of 8704 tokens (the 4096
   queries deepest in it, [4096, 8704], k = 256), topk_cuda's variants against topk_triton, randn scores;
6. times decode's shapes (`rows_sweep`): B = 1-256 rows of 4096-131072 scores, k = 2048, every variant that
   takes them and topk_cuda's pick: where the two-block cluster of variant 9 stops paying, and the short
   variants against 0-4 at decode's short widths (4096; mini's tight engine's 4224; the short graphs' 8192, full
   and with 4096 valid scores).
Each section catches its own exceptions; the JSON is rewritten after every section. --sections runs some of
them (the build always).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.ops.dsa import by_position, cuda_topk, topk_select  # noqa: E402

NAN, INF = float("nan"), float("inf")
TRITON_DEADLINE_S = 75  # past this many seconds of the run, the remaining topk_triton comparisons are skipped
SECTIONS = ("cases", "timing", "graph", "shapes", "rows_sweep")


def cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, scores [B, L] on the GPU, lens [B], k) of every correctness case."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for L in (1, 7, 37, 257, 4099):
        scores = torch.randn(4, L, generator=g, device=dev)
        lens = torch.tensor([1, L, L // 2 + 3, 0], device=dev)
        for k in (1, 5, 64, 300, 2048):
            out.append((f"randn L={L} k={k}", scores, lens, k))
    scores = torch.randn(5, 300, generator=g, device=dev)
    lens = torch.tensor([300, -4, 1000, 17, 0], device=dev)
    out.append(("int32 lens out of range k=64", scores, lens.int(), 64))
    out.append(("int64 lens out of range k=300", scores, lens, 300))
    ties = torch.randint(-3, 4, (5, 1000), generator=g, device=dev).float()
    ties[torch.rand(5, 1000, generator=g, device=dev) < 0.1] = NAN
    for k in (1, 7, 300):
        out.append((f"7 values + NaN k={k}", ties, torch.tensor([1000, 1, 570, 999, 640], device=dev), k))
    ulps = torch.randint(0, 6, (3, 800), generator=g, device=dev).int()
    close = (torch.tensor(1.5, device=dev).view(torch.int32) + ulps).view(torch.float32)
    out.append(("scores ulps apart k=300", close, torch.tensor([800, 410, 777], device=dev), 300))
    mixed = [-INF, 2.0, NAN, -INF, INF, 0.0, -0.0, 0.0, NAN, -1e-45, 1e-45, -0.0, 3e38, -3e38, INF, 2.0, -INF]
    special = torch.tensor([mixed, [NAN] * 17, [0.0, -0.0] * 8 + [NAN], [-INF] * 17, [INF] * 17], device=dev)
    for k in (1, 5, 17, 40):
        out.append((f"special values k={k}", special, torch.tensor([17, 17, 16, 17, 9], device=dev), k))
    base = torch.randn(4, 500, generator=g, device=dev)
    lens = torch.tensor([1, 9, 500, 140], device=dev)
    padded = torch.arange(500, device=dev)[None, :] >= lens[:, None]
    for garbage in (NAN, INF, 1e30):
        out.append((f"garbage {garbage} past lens k=8", base.masked_fill(padded, garbage), lens, 8))
    wide = torch.randn(6, 4131, generator=g, device=dev)
    lens = torch.tensor([4099, 3, 77, 4098, 0, 2000], device=dev)
    for start in range(4):
        out.append((f"row stride 4131, start {start} k=300", wide[:, start : start + 4099], lens, 300))
    out.append(
        ("column stride != 1 k=5", wide.t()[:9, :6].t(), torch.tensor([9, 3, 1, 6, 0, 9], device=dev), 5)
    )
    equal = torch.full((3, 131072), 0.5, device=dev)
    out.append(("all equal k=2048", equal, torch.tensor([131072, 90001, 2047], device=dev), 2048))
    step = equal.clone()
    step[1, 70000:] = 0.75
    out.append(("all equal, higher tail k=2048", step, torch.tensor([131072, 131072, 5], device=dev), 2048))
    for B, L, k in ((64, 131072, 2048), (16, 32768, 2048), (3, 5000, 2048), (4, 70000, 64)):
        for kind in ("randn", "ties", "few"):
            if kind == "randn":
                scores = torch.randn(B, L, generator=g, device=dev)
            elif kind == "ties":
                scores = torch.randint(0, 300, (B, L), generator=g, device=dev).float()
            else:
                scores = torch.randint(0, 3, (B, L), generator=g, device=dev).float()
            scores[torch.rand(B, L, generator=g, device=dev) < 0.01] = NAN
            lens = torch.randint(1, L + 1, (B,), generator=g, device=dev)
            lens[0], lens[-1] = L, 1
            out.append((f"{kind} {B}x{L} k={k}", scores, lens, k))
    full = torch.randn(64, 131072, generator=g, device=dev)
    out.append(("randn 64x131072 full lens k=2048", full, torch.full((64,), 131072, device=dev), 2048))
    tri = torch.randn(4096, 4096, generator=g, device=dev)
    tri[torch.rand(4096, 4096, generator=g, device=dev) < 0.01] = NAN
    out.append(("prefill triangle 4096x4096 k=2048", tri, torch.arange(1, 4097, device=dev), 2048))
    return out + short_cases(g)


def short_cases(g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """Cases aimed at the short variants (5-8, rows in registers): rows of exactly 4096 and 8192 scores and one
    more, rising to their end (the last slot's scores selected); unaligned row pointers near the widest;
    all-equal and all -inf rows; few values in every key byte; special values; lens edges in 300 rows."""
    dev = "cuda"
    out = []
    for L in (4096, 4097, 8192, 8193):
        scores = torch.randn(4, L, generator=g, device=dev) + torch.linspace(-3, 3, L, device=dev)
        lens = torch.tensor([L, L - 1, 2049, 10**6], device=dev)
        for k in (1, 2048, L + 3):
            out.append((f"short: rising {L} k={k}", scores, lens, k))
    wide = torch.randn(3, 8200, generator=g, device=dev) + torch.linspace(0, 4, 8200, device=dev)
    for start in range(4):
        for L in sorted({4093, 4096 - start, 4096, 8189, 8192 - start, 8192}):  # head = start
            lens = torch.tensor([L, L - 1, 2049], device=dev)
            out.append(
                (f"short: start {start} of 8200, {L} wide k=2048", wide[:, start : start + L], lens, 2048)
            )
    odd = torch.randn(3, 8193, generator=g, device=dev)  # row stride 8193: every head taken as 3
    out.append(
        (
            "short: row stride 8193, 8189 wide k=2048",
            odd[:, :8189],
            torch.tensor([8189, 5, 8000], device=dev),
            2048,
        )
    )
    equal = torch.full((3, 8192), 0.5, device=dev)
    equal[1] = -INF
    for k in (1, 2048):
        out.append(
            (f"short: all 0.5, all -inf, 8192 k={k}", equal, torch.tensor([8192, 4096, 2047], device=dev), k)
        )
    bits = torch.zeros(6, 8192, dtype=torch.int64, device=dev)
    for values in ([0x3F, 0x40, 0xBF, 0xC0], [0x00, 0x80, 0xFF], [0x00, 0x7F, 0x80], [0x00, 0x01, 0xFF]):
        pick = torch.randint(0, len(values), (6, 8192), generator=g, device=dev)
        bits = bits * 256 + torch.tensor(values, device=dev)[pick]
    few = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    lens = torch.tensor([8192, 8191, 4096, 4097, 2048, 1], device=dev)
    for k in (1, 76, 2048, 4000):
        out.append((f"short: 108 values, ties in every key byte, 8192 k={k}", few, lens, k))
    pool = torch.tensor([-INF, -3.3e38, -2.0e38, NAN, INF, 0.0, -0.0, 1e-45, -1e-45, 2.0, -2.0], device=dev)
    special = pool[torch.randint(0, len(pool), (3, 4096), generator=g, device=dev)]
    special[1] = pool[torch.randint(0, 4, (4096,), generator=g, device=dev)]  # T among -inf and below -2^127
    special[1, :100] = torch.randn(100, generator=g, device=dev)
    for k in (1, 101, 2048, 5000):
        out.append(
            (f"short: special values 4096 k={k}", special, torch.tensor([4096, 4096, 3000], device=dev), k)
        )
    k = 2048
    rows = torch.randn(300, 4224, generator=g, device=dev)
    lens = torch.randint(0, 4225, (300,), generator=g, device=dev)
    lens[:10] = torch.tensor([0, 1, k - 1, k, k + 1, 4223, 4224, 4225, -5, 10**6], device=dev)
    out.append(("short: 300 rows of 4224, lens edges, int32 k=2048", rows, lens.int(), k))
    out.append(("short: 1 row of 4224 k=1", rows[:1], lens[6:7], 1))
    return out


def takes(variant: int, scores: torch.Tensor) -> bool:
    """Whether kernel `variant` takes these scores' rows (the short variants take rows up to a width)."""
    return cuda_topk.variant_takes(variant, scores if scores.stride(-1) == 1 else scores.contiguous())


def variants_for(scores: torch.Tensor) -> list[int]:
    """The kernel variants that take these scores' rows."""
    return [v for v in range(cuda_topk.num_variants()) if takes(v, scores)]


def poisoned_run(fn, scores, lens, k, **kwargs) -> torch.Tensor:
    out = torch.full((scores.shape[0], k), -7, dtype=torch.int64, device=scores.device)
    got = fn(scores, lens, k, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr(), "did not write into out"
    return got


def check_cases(result: dict, started: float) -> None:
    rows = result["cases"] = []
    all_cases = cases()
    for name, scores, lens, k in all_cases:
        row = {"case": name}
        try:
            want = by_position(topk_select(scores, lens.long() - 1, k))
            for v in range(cuda_topk.num_variants()):
                if not takes(v, scores):
                    row[f"naive_ok_v{v}"] = "skipped: rows wider than the variant takes"
                    continue
                got = poisoned_run(cuda_topk.topk_cuda, scores, lens, k, variant=v)
                ok = row[f"naive_ok_v{v}"] = bool(torch.equal(got, want))
                if not ok:
                    bad = (got != want).any(-1).nonzero().flatten()
                    r = int(bad[0])
                    row[f"failure_v{v}"] = {
                        "first_bad_row": r,
                        "bad_rows": int(bad.numel()),
                        "got": got[r, :12].tolist(),
                        "want": want[r, :12].tolist(),
                        "unwritten": int((got == -7).sum()),
                    }
            row["naive_ok"] = row[f"naive_ok_v{cuda_topk.DEFAULT_VARIANT}"]
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:500]
        rows.append(row)
    for v in range(cuda_topk.num_variants()):
        passed = sum(r.get(f"naive_ok_v{v}") is True for r in rows)
        skipped = sum(isinstance(r.get(f"naive_ok_v{v}"), str) for r in rows)
        print(f"naive, variant {v}: {passed}/{len(rows) - skipped} cases pass, {skipped} skipped", flush=True)
    try:
        from kestrel.ops.dsa.triton_topk import topk_triton
    except Exception as e:  # noqa: BLE001
        result["triton_import_error"] = repr(e)[:500]
        return
    for row, (_, scores, lens, k) in zip(rows, all_cases):
        if time.perf_counter() - started > TRITON_DEADLINE_S:
            row["triton_ok"] = "skipped (time)"
            continue
        try:
            want = poisoned_run(topk_triton, scores, lens, k)
            row["triton_ok"] = bool(torch.equal(cuda_topk.topk_cuda(scores, lens, k), want))
        except Exception as e:  # noqa: BLE001
            row["triton_error"] = repr(e)[:500]
    done = [r for r in rows if isinstance(r.get("triton_ok"), bool)]
    print(f"triton: {sum(r['triton_ok'] for r in done)}/{len(done)} compared cases equal", flush=True)


def time_us(fn, flush: bool, reps: int = 50, warmup: int = 10) -> float:
    """Median microseconds of fn() over `reps` CUDA-event pairs, the L2 flushed before each when `flush`."""
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush:
            cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def scores_of(kind: str, B: int, L: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    if kind == "randn":
        return torch.randn(B, L, generator=g, device="cuda")
    if kind == "ramp":
        return torch.randn(B, L, generator=g, device="cuda") + torch.linspace(0, 6, L, device="cuda")
    return torch.randint(0, 300, (B, L), generator=g, device="cuda").float()  # ties


def timing(result: dict) -> None:
    from kestrel.ops.dsa.triton_topk import topk_triton

    B, L, k = 64, 131072, 2048
    lens = torch.full((B,), L, device="cuda")
    out = torch.empty(B, k, dtype=torch.int64, device="cuda")
    rows = result["timing"] = {"shape": [B, L], "k": k}
    for kind in ("randn", "ramp", "ties"):
        scores = scores_of(kind, B, L)
        fns = {
            "topk_cuda": lambda s=scores: cuda_topk.topk_cuda(s, lens, k, out=out),
            **{
                f"topk_cuda_v{v}": lambda s=scores, v=v: cuda_topk.topk_cuda(s, lens, k, out=out, variant=v)
                for v in variants_for(scores)
            },
            "topk_triton": lambda s=scores: topk_triton(s, lens, k, out=out),
            "torch_topk": lambda s=scores: torch.topk(s, k, dim=-1),
        }
        entry = rows[kind] = {}
        for name, fn in fns.items():
            try:
                entry[name] = {"cold_us": time_us(fn, flush=True), "warm_us": time_us(fn, flush=False)}
            except Exception as e:  # noqa: BLE001
                entry[name] = {"error": repr(e)[:300]}
        cuda_us = entry["topk_cuda"].get("cold_us")
        for peer in ("topk_triton", "torch_topk"):
            if cuda_us and "cold_us" in entry[peer]:
                entry[f"{peer}_over_cuda_cold"] = entry[peer]["cold_us"] / cuda_us
        print(
            f"{kind:6s} "
            + "  ".join(
                f"{n} {v.get('cold_us', float('nan')):7.1f} us" for n, v in entry.items() if "_over_" not in n
            ),
            flush=True,
        )


def check_and_time(entry: dict, fns: dict, out: torch.Tensor, want: torch.Tensor) -> None:
    """entry[name] = whether fns[name]() (each writing `out`, poisoned before it) selected `want`, and its
    L2-flushed microseconds."""
    for name, fn in fns.items():
        try:
            # an output that a function leaves unwritten must not pass on the one before's result
            out.fill_(-7)
            fn()
            equal = bool(torch.equal(out, want))
            entry[name] = {"equal_naive": equal, "cold_us": time_us(fn, flush=True, reps=20, warmup=3)}
        except Exception as e:  # noqa: BLE001
            entry[name] = {"error": repr(e)[:300]}


def shapes(result: dict) -> None:
    from kestrel.ops.dsa.triton_topk import topk_triton

    cases = {  # name: (rows, row length, the first row's len, k); row i's len is the first's + i (causal)
        "prefill_mini_4096": (4096, 4096, 1, 2048),
        "train_demo_8704": (4096, 8704, 8704 - 4096 + 1, 256),
    }
    rows = result["shapes"] = {}
    for name, (B, L, first, k) in cases.items():
        scores = scores_of("randn", B, L)
        lens = torch.arange(first, first + B, device="cuda")
        out = torch.empty(B, k, dtype=torch.int64, device="cuda")
        want = by_position(topk_select(scores, lens - 1, k))
        entry = rows[name] = {"shape": [B, L], "k": k, "lens": [first, first + B - 1]}
        fns = {
            **{
                f"topk_cuda_v{v}": functools.partial(cuda_topk.topk_cuda, scores, lens, k, out=out, variant=v)
                for v in variants_for(scores)
            },
            "topk_triton": functools.partial(topk_triton, scores, lens, k, out=out),
        }
        check_and_time(entry, fns, out, want)
        print(
            f"{name}: " + "  ".join(f"{n} {v}" for n, v in entry.items() if n.startswith("topk")), flush=True
        )


def rows_sweep(result: dict) -> None:
    """Decode's shapes: B rows of width L, k = 2048, every variant that takes them and `auto` (topk_cuda's own
    pick, cuda_topk.choose_variant), to find where a row's second block (variant 9, a two-block cluster) stops
    paying (it should while 2 B blocks fit the SMs and rows are wide) and how the short variants (5-8, rows in
    registers) compare with 0-4 on rows of 4096, 4224 and 8192. Full rows, and rows of 4096 valid scores in
    8192- and 131072-wide buffers (decode's graphs pad the scores to the longest context they take)."""
    k = 2048
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = result["rows_sweep"] = {"k": k, "sms": sms, "cluster_min_l": cuda_topk.CLUSTER_MIN_L}
    shapes = [(L, B, L) for L in (4096, 131072) for B in (1, 4, 16, 64, 128, 256)]
    shapes += [(L, B, L) for L in (4224, 8192) for B in (1, 4, 64, 256)]  # mini's tight width; short graphs'
    shapes += [(8192, B, 4096) for B in (1, 4, 64, 256)]  # decode at 4K context in a short graph
    shapes += [(L, B, L) for L in (16384, 32768, 65536) for B in (1, 64)]
    shapes += [(131072, B, 4096) for B in (1, 64, 256)]
    for L, B, valid in shapes:
        scores = scores_of("randn", B, L)
        lens = torch.full((B,), valid, device="cuda")
        out = torch.empty(B, k, dtype=torch.int64, device="cuda")
        want = by_position(topk_select(scores, lens - 1, k))
        name = f"{B}x{L}" + ("" if valid == L else f" lens {valid}")
        entry = rows[name] = {
            "auto_picks": cuda_topk.variant_for(B, L, scores.device, cuda_topk.row_slots(scores))
        }
        fns = {
            **{
                f"v{v}": functools.partial(cuda_topk.topk_cuda, scores, lens, k, out=out, variant=v)
                for v in variants_for(scores)
            },
            "auto": functools.partial(cuda_topk.topk_cuda, scores, lens, k, out=out),
        }
        check_and_time(entry, fns, out, want)
        print(f"rows {name}: " + "  ".join(f"{n} {v}" for n, v in entry.items()), flush=True)


def graph_check(result: dict) -> None:
    B, L, k = 64, 131072, 2048
    scores = scores_of("randn", B, L)
    lens = torch.randint(1, L + 1, (B,), device="cuda")
    fresh_scores, fresh_lens = scores_of("ramp", B, L), torch.randint(1, L + 1, (B,), device="cuda")
    fresh_lens[0] = L
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cuda_topk.topk_cuda(scores, lens, k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_topk.topk_cuda(scores, lens, k)
    scores.copy_(fresh_scores)
    lens.copy_(fresh_lens)
    graph.replay()
    torch.cuda.synchronize()
    want = by_position(topk_select(fresh_scores, fresh_lens - 1, k))
    result["graph"] = {
        "replay_equal_eager": bool(torch.equal(captured, cuda_topk.topk_cuda(fresh_scores, fresh_lens, k))),
        "replay_equal_naive": bool(torch.equal(captured, want)),
        "replay_warm_us": time_us(graph.replay, flush=False),
        "replay_cold_us": time_us(graph.replay, flush=True),
    }
    print(f"graph: {result['graph']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "topk_cuda.json"))
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all; the build always runs)",
    )
    args = parser.parse_args()
    chosen = [name for name in args.sections.split(",") if name]
    if unknown := sorted(set(chosen) - set(SECTIONS)):
        parser.error(f"unknown sections {unknown}: pick from {', '.join(SECTIONS)}")
    started = time.perf_counter()
    result: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "sections": chosen,
    }

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - started
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    def section(name: str, fn) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001
            result.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            print(f"{name} failed:\n{result['errors'][name]}", flush=True)
        save()

    def build() -> None:
        result["gpu"] = torch.cuda.get_device_name()
        nvcc = cuda_topk.find_nvcc()
        result["nvcc"] = nvcc and subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        t0 = time.perf_counter()
        path = cuda_topk.build(verbose=True)
        source = hashlib.sha256(cuda_topk.SOURCE.read_bytes()).hexdigest()[:16]
        result["build"] = {"seconds": time.perf_counter() - t0, "library": str(path), "source_sha256": source}
        result["available"] = cuda_topk.available()
        result["variants"] = cuda_topk.num_variants()
        result["default_variant"] = cuda_topk.DEFAULT_VARIANT
        result["unavailable_reason"] = cuda_topk.UNAVAILABLE_REASON
        print(f"build: {result['build']}, available: {result['available']}", flush=True)

    section("build", build)
    if result.get("available"):
        runs = {
            "cases": lambda: check_cases(result, started),
            "timing": lambda: timing(result),
            "graph": lambda: graph_check(result),
            "shapes": lambda: shapes(result),
            "rows_sweep": lambda: rows_sweep(result),
        }
        for name in SECTIONS:  # in this order, whatever the order asked
            if name in chosen:
                section(name, runs[name])
    save()
    print(f"wrote {args.out} in {result['elapsed_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
