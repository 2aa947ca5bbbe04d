"""Where a `kestrel train` step's time goes on the GPU: step times in the dense warm-up and in sparse DSA
training (each read back before the next; and as the loop runs them: each read after the next is queued), the
data loader's share, the host syncs of one step (torch's sync debug mode), and the top CUDA kernels and CPU ops
of each phase (torch.profiler).

    python3 scripts/profile_train.py --batch-rows 16 --row-len 8704 --out $OUT/profile_train.json
    python3 scripts/profile_train.py --model mini --batch-rows 2 --row-len 8704   # the loop on a larger model
    python3 scripts/profile_train.py --model mini --batch-rows 2 --row-len 8704 --grad-accum 2
        # two batches a step, each its own forward and backward, one optimizer step
    python3 scripts/profile_train.py --model mini --batch-rows 2 --row-len 8704 --timed-steps 6   # steadier figures
    python3 scripts/profile_train.py --phases dense --stack-every 30
        # one phase, with every thread's stack printed each 30 s: where a slow first step is (compiling or running)

Each phase reports torch.compile's graph counts after it (`compiled_graphs`): a count that grows with the steps
is a recompilation at every step; its peak memory (`max_memory_gib`); and its attention accounting (`attention`):
the MFU counts each token attending to half its row, and beside it are the pairs the batches' documents need
(each document causal on its own; at most top-k keys a query in the sparse phase) and the MFU with those counted,
the fair figure for a kernel that skips other documents' keys (flex, the default; `KESTREL_TRAIN_ATTENTION=sdpa`
computes every pair of the row).

Who sets the pace: `gpu_busy` is the share of the queued steps' span in which some kernel ran (a CUDA-only
profile; below 1, the GPU waited on the host), `host_issue_s` the host's seconds a step in `launch_step`,
`host_profile` the host's functions by cProfile (the main thread's: autograd's own thread is not seen), and
`op_sites` the Python call sites of one step's copying ops (cat, copy_, casts, clones, indexing).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench.profiling import busy_time, ops_by_shape  # noqa: E402
from kestrel.config import TrainConfig  # noqa: E402
from kestrel.train.trainer import Trainer  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _label_modules(model: torch.nn.Module) -> None:
    """Profiler ranges `fwd::<class>` around the whole stack (KimiModel), each attention and MLP block, and the
    LM head (forward only: autograd runs the backward outside them). The stack's time minus its blocks' is
    the norms and the AttnRes mixing."""
    from torch.autograd.profiler import record_function

    def enter(module, args):
        module._range = record_function(f"fwd::{type(module).__name__}")
        module._range.__enter__()

    def leave(module, args, out):
        module._range.__exit__(None, None, None)

    for name, module in model.named_modules():
        parts = name.split(".")
        if name in ("model", "lm_head") or (
            name.startswith("model.layers.") and parts[-1] in ("self_attn", "mlp")
        ):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)


def _label_dsa_training(model: torch.nn.Module) -> None:
    """Profiler ranges `fwd::dsa_select` and `fwd::indexer_kl` around the sparse-training selection (indexer
    scores of the row-packed tokens, the top-k, the mask) and the forward of the indexer's KL loss (both phases)
    in every DSA layer. They sit inside `fwd::MLAttention` (do not add them to it). The sparse step's cost over
    the dense one (0.297 vs 0.237 s compiled, session 10) is in `fwd::dsa_select`."""
    from torch.autograd.profiler import record_function

    from kestrel.layers.mla import MLAttention

    def labelled(fn, label):
        def run(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)

        return run

    for module in model.modules():
        if isinstance(module, MLAttention):
            module._select_rows = labelled(module._select_rows, "fwd::dsa_select")
            module._indexer_kl = labelled(module._indexer_kl, "fwd::indexer_kl")


def _compile_stats() -> dict:
    """torch.compile's counts so far: graphs compiled and frames captured."""
    from torch._dynamo.utils import counters

    stats = counters["stats"]
    return {"unique_graphs": stats.get("unique_graphs", 0), "calls_captured": stats.get("calls_captured", 0)}


def _pinned(step: list) -> list:
    """A step's batches pinned, as the loop's are (on CUDA)."""
    return [b.pin_memory() for b in step] if torch.cuda.is_available() else step


def _host_syncs(trainer: Trainer, step: list) -> dict:
    """One step queued with torch's sync debug mode on: every place it waits for the GPU that torch reports (a
    read-back, a blocking copy, an op whose output size depends on the data), by message and the innermost
    Kestrel and fla frames of the stack. Syncs of the backward are reported at its `backward()` call. The
    blocking copies of fla's chunk index run on a side stream (`_warm_chunk_index`): they wait for nothing else
    queued, though torch reports them too."""
    import traceback
    import warnings
    from collections import Counter

    sites: Counter = Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return  # torch's note that the debug mode is a prototype (counted as a sync in session 17's run)
        frames = [
            f for f in traceback.extract_stack()[:-1] if "/kestrel/" in f.filename or "/fla/" in f.filename
        ]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-4:]))
        sites[(str(message).splitlines()[0][:100], where)] += 1

    _sync()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.launch_step(_pinned(step))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    found = [{"message": m, "where": w, "count": n} for (m, w), n in sites.most_common()]
    return {"count": sum(sites.values()), "sites": found}


def _queued(trainer: Trainer, timed: list) -> tuple[float, float]:
    """The loop's way: each step queued, then the one before it read back (Trainer.train). Returns the seconds a
    step and the host's seconds a step in `launch_step` (its Python and launches; near the step's own when the
    host, not the GPU, sets the pace)."""
    t0, before, issue = time.perf_counter(), None, 0.0
    for b in timed:
        t1 = time.perf_counter()
        queued = trainer.launch_step(_pinned(b))
        issue += time.perf_counter() - t1
        if before is not None:
            before.read()
        before = queued
    before.read()
    return (time.perf_counter() - t0) / len(timed), issue / len(timed)


def _gpu_busy(trainer: Trainer, timed: list) -> dict:
    """The queued steps again under a CUDA-only profiler (no CPU-side recording to slow the host): the share of
    the span from their first kernel's start to their last kernel's end in which some kernel or copy ran. What
    is missing is the GPU waiting on the host (launch overhead, Python, host syncs)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _queued(trainer, timed)
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    busy, span = busy_time(spans)  # us
    return {
        "busy_fraction": busy / span if span else float("nan"),
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "kernels": len(spans),
    }


def _host_profile(trainer: Trainer, timed: list, top: int) -> dict:
    """The host's side of the queued steps (cProfile: its own overhead inflates the Python functions' times,
    not the ops they call): the functions with the most time of their own (`self_ms`) and the most time within
    them (`total_ms`), a step's worth each. Where a step's host time goes when the host sets the pace."""
    import cProfile
    import pstats

    _sync()
    prof = cProfile.Profile()
    prof.enable()
    _queued(trainer, timed)
    prof.disable()
    # {(file, line, name): (calls, primitive calls, self s, total s, callers)}
    stats = pstats.Stats(prof).stats
    n = len(timed)

    def rows(key: int) -> list:
        best = sorted(stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top]
        return [
            {
                "function": f"{Path(f).name}:{line}:{fn}",
                "calls": c // n,
                "self_ms": 1e3 * own / n,
                "total_ms": 1e3 * total / n,
            }
            for (f, line, fn), (c, _, own, total, _) in best
        ]

    return {"by_self": rows(2), "by_total": rows(3)}


_NODE = "autograd::engine::evaluate_function: "  # the profiler's range around each backward node it runs
_SITE_OPS = ("aten::cat", "aten::copy_", "aten::_to_copy", "aten::clone", "aten::index", "aten::index_put_")


def _op_sites(trainer: Trainer, step: list, top: int) -> list:
    """Where the copying ops of one step come from: each call of `_SITE_OPS` counted by (op, first input's
    shape, the innermost two kestrel functions around it, each as file(first line): name, up to the backward
    node that ran it, "(backward) CatBackward0", if any: on CUDA autograd runs the backward on its own thread,
    without Python frames; "(no kestrel frame)" for an op with neither). A profile with stacks, so compiled code
    stays compiled (a dispatch mode would turn torch.compile off, and flex attention's operator refuses one).
    The profile's tables name an op and a shape, not its caller. On the H200 with torch 2.11 (session 31) the
    forward's ops came without Python frames: only the backward's nodes were named."""
    import collections
    import functools

    from torch.profiler import ProfilerActivity, profile

    import kestrel

    root = Path(kestrel.__file__).resolve().parent

    @functools.cache
    def in_kestrel(name: str) -> str | None:  # "<file>(99): forward" -> "layers/mla.py(99): forward", or None
        file = name.split("(", 1)[0]  # absolute, or shortened by the profiler to a sys.path entry's
        path = Path(file) if Path(file).is_absolute() else root.parent / file
        try:
            return f"{path.resolve().relative_to(root)}{name[len(file) :]}"
        except (ValueError, OSError):
            return None

    _sync()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        trainer.train_step(step)
        _sync()
    counts = collections.Counter()
    for e in prof.events():
        if e.name not in _SITE_OPS:
            continue
        frames, up = [], e.cpu_parent  # with_stack: the Python calls are the op's ancestors, innermost first
        while up is not None and len(frames) < 2:
            if up.name.startswith(_NODE):  # the backward node that ran it: the outermost name worth giving
                frames.append(f"(backward) {up.name[len(_NODE) :]}")
                break
            frame = in_kestrel(up.name) if ".py(" in up.name else None
            if frame is not None:
                frames.append(frame)
            up = up.cpu_parent
        site = " <- ".join(frames) or "(no kestrel frame)"
        shape = str(e.input_shapes[0]) if e.input_shapes else "[]"
        counts[(e.name, shape, site)] += 1
    return [
        {"op": op, "shape": shape, "site": site, "calls": n}
        for (op, shape, site), n in counts.most_common(top)
    ]


def _phase(trainer: Trainer, steps: list, dense: bool, top: int) -> dict:
    """steps: lists of grad_accum batches: the first compiles, the last is profiled, those between are timed (read
    back one by one, then queued as the loop runs them)."""
    trainer.step = 0 if dense else trainer.cfg.dsa_dense_steps
    name = "dense" if dense else "sparse"
    print(f"{name}: first step (compilation, autotuning) ...", flush=True)
    t0 = time.perf_counter()
    trainer.train_step(steps[0])  # warm-up (compilation, autotuning, allocator)
    _sync()
    first_s = time.perf_counter() - t0
    after_first = _compile_stats()
    print(f"{name}: first step {first_s:.1f} s, compiled {after_first}", flush=True)
    times = []
    timed = steps[1:-1]
    for b in timed:
        t0 = time.perf_counter()
        trainer.train_step(b)
        _sync()
        times.append(time.perf_counter() - t0)
        print(f"{name}: step {times[-1]:.3f} s", flush=True)
    queued_s, issue_s = _queued(trainer, timed)
    print(f"{name}: queued steps {queued_s:.3f} s each (the host's issue {issue_s:.3f} s)", flush=True)
    cuda = torch.cuda.is_available()
    busy = _diagnosis(_gpu_busy, trainer, timed) if cuda else None
    if busy is not None and "error" not in busy:
        print(f"{name}: GPU busy {busy['busy_fraction']:.1%} of the queued steps' span", flush=True)
    host = _diagnosis(_host_profile, trainer, timed, top)
    sites = _diagnosis(_op_sites, trainer, steps[-1], 2 * top)
    syncs = _diagnosis(_host_syncs, trainer, steps[-1]) if cuda else None
    if syncs is not None and "error" not in syncs:
        print(f"{name}: {syncs['count']} host syncs in one step", flush=True)
    tokens = sum(b.input_ids.numel() for b in steps[0])  # a step's (every batch has batch_rows x row_len)
    return {
        "first_step_s": first_s,
        "step_s": times,
        "tokens_per_s": tokens / (sum(times) / len(times)),
        "queued_step_s": queued_s,
        "queued_tokens_per_s": tokens / queued_s,
        "host_issue_s": issue_s,
        "gpu_busy": busy,
        "host_profile": host,
        "op_sites": sites,
        "host_syncs": syncs,
        "profile": _diagnosis(_profiled_step, trainer, steps[-1], top),
        "compiled_graphs": {"after_first_step": after_first, "after_phase": _compile_stats()},
    }


def _diagnosis(fn, *args):
    """fn(*args), or {"error": ...} where it fails (out of memory, a profiler's limit): a diagnosis after the
    timing must not lose the phase's measurements. A step cut short leaves its gradients for the next step's
    start to drop (`Trainer.launch_step`); the cache is emptied once the failure's traceback is gone."""
    try:
        return fn(*args)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"[:300]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"error": error}


def _profiled_step(trainer: Trainer, step: list, top: int) -> dict:
    """One step under the profiler (CPU and CUDA): its top kernels, the forward's modules, the most called
    ops, the ops by shape, and the kernels' total time and launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        trainer.train_step(step)
        _sync()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # not the CPU ops that launched them
    by_gpu = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    by_calls = sorted(events, key=lambda e: e.count, reverse=True)[:top]
    modules = [e for e in events if e.key.startswith("fwd::")]
    return {
        "top_gpu_kernels": [
            {"name": e.key[:90], "gpu_ms": e.self_device_time_total / 1e3, "calls": e.count} for e in by_gpu
        ],
        "forward_by_module": [
            {
                "name": e.key,
                "gpu_ms": getattr(e, "device_time_total", 0) / 1e3,
                "cpu_ms": e.cpu_time_total / 1e3,
            }
            for e in modules
        ],
        "most_called_ops": [{"name": e.key[:90], "calls": e.count} for e in by_calls],
        "top_ops_by_shape": ops_by_shape(prof, top, time_key="gpu_ms"),
        "kernel_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "kernel_launches": sum(e.count for e in kernels),
    }


def _attention_accounting(trainer: Trainer, steps: list, phase: dict, sparse: bool) -> dict:
    """The MFU's attention FLOPs beside what the batches' documents need: `flops_per_token` counts each token
    attending to half its row (row_len / 2 keys, the usual convention for packed rows); a kernel that skips
    other documents' keys does each document's causal pairs only (and sparse DSA training at most top-k keys a
    query). `queued_mfu_document_causal` is the queued steps' MFU with those pairs counted instead."""
    from kestrel.train.flops import attention_flops_per_pair, visible_pairs_per_token

    model = trainer.model
    topk = model.config.index_topk if sparse else None
    bounds = [batch.cu_seqlens.tolist() for step in steps for batch in step]
    seqlens = [b - a for seg in bounds for a, b in zip(seg, seg[1:])]
    counted = trainer.cfg.row_len / 2
    needed = visible_pairs_per_token(seqlens, topk)
    per_pair = attention_flops_per_pair(model)
    flops = trainer.flops_per_token - per_pair * counted + per_pair * needed
    return {
        "pairs_per_token_counted": counted,
        "pairs_per_token_document_causal": needed,
        "flops_per_token_document_causal": flops,
        "queued_mfu_document_causal": phase["queued_tokens_per_s"] * flops / 989e12,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-rows", type=int, default=16)
    ap.add_argument(
        "--grad-accum", type=int, default=1, help="batches a step (each its own forward and backward)"
    )
    ap.add_argument("--timed-steps", type=int, default=2, help="steps timed in each phase, after the first")
    ap.add_argument("--row-len", type=int, default=8704)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="demo", help="preset (random init) or checkpoint folder")
    ap.add_argument("--phases", default="dense,sparse", help="comma-separated: dense (warm-up), sparse (DSA)")
    ap.add_argument(
        "--stack-every", type=float, default=0, help="print every thread's stack each S seconds (0: never)"
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (default: the shipped demo model's; a BPE is trained when there is none)",
    )
    args = ap.parse_args()
    phases = args.phases.split(",")
    if not phases or set(phases) - {"dense", "sparse"}:
        ap.error(f"--phases: choose from dense, sparse (got {args.phases!r})")
    if args.grad_accum < 1 or args.timed_steps < 1:
        ap.error(f"--grad-accum and --timed-steps must be >= 1 (got {args.grad_accum}, {args.timed_steps})")
    if args.stack_every > 0:
        faulthandler.dump_traceback_later(args.stack_every, repeat=True)
    from kestrel.presets import preset_config, preset_names, shipped_model_dir
    from kestrel.tokenizer import load_tokenizer

    shipped = shipped_model_dir()
    if shipped is not None and not (  # a preset the shipped tokenizer fits, else a BPE trained for it
        args.model in preset_names()
        and preset_config(args.model).vocab_size >= load_tokenizer(str(shipped)).vocab_size
    ):
        shipped = None
    cfg = TrainConfig(
        out_dir=tempfile.mkdtemp(),
        model=args.model,
        tokenizer=args.tokenizer or (str(shipped) if shipped is not None else None),
        steps=1000,
        batch_rows=args.batch_rows,
        grad_accum=args.grad_accum,
        row_len=args.row_len,
        retrieval_lengths=(2048, 8192) if args.row_len > 8192 else (2048,),
        dsa_dense_steps=500,
        data_workers=args.workers,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    _label_modules(trainer.model)
    _label_dsa_training(trainer.model)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = args.grad_accum
    per_phase = args.timed_steps + 2  # the first (compiling), the timed ones, the profiled one
    steps = [[next(trainer.data) for _ in range(n)] for _ in range(2 * per_phase)]
    data_s = (time.perf_counter() - t0) / (2 * per_phase * n)
    print(f"setup {setup_s:.1f} s, data {data_s:.2f} s/batch", flush=True)
    result = {
        "command": " ".join(sys.argv),
        "model": args.model,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "setup_s": setup_s,
        "data_s_per_batch": data_s,
        "docs_per_batch": len(steps[0][0].cu_seqlens) - 1,
        "flops_per_token": trainer.flops_per_token,
    }
    for phase, part in (("dense", steps[:per_phase]), ("sparse", steps[per_phase:])):
        if phase in phases:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # max_memory_gib: this phase's peak
            result[phase] = _phase(trainer, part, dense=phase == "dense", top=args.top)
            result[phase]["mfu_vs_989"] = trainer.mfu(result[phase]["tokens_per_s"])
            result[phase]["queued_mfu_vs_989"] = trainer.mfu(result[phase]["queued_tokens_per_s"])
            result[phase]["attention"] = _attention_accounting(
                trainer, part, result[phase], sparse=phase == "sparse"
            )
            if torch.cuda.is_available():
                result[phase]["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if args.out:  # each phase as it ends: a later failure keeps the earlier phases
                Path(args.out).write_text(json.dumps(result, indent=1))
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
