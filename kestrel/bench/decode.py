"""`kestrel bench decode`: the engine's decode step on a GPU, against the HBM roofline of the same run.

Requests are placed directly in decode at a given context (slots and pages allocated, the pools filled with
random values: a decode step's time does not depend on them), so 128K contexts need no prefill. Per batch
size the step is timed through `Engine.step()` (what a user gets: scheduling, sampling and Python included),
with the engine's overlap schedule and without it, and as the bare CUDA-graph replay (since session 40 the graph
also gathers its page table and ends with the greedy rows' argmax, work that ran outside it before). MBU = bytes a step
must move / step time / measured copy bandwidth, with bytes = weights touched (every dense weight, the experts
the batch hits, the LM head) + KDA state read and written + the MLA/DSA cache read (indexer keys of every
position, latent rows of the selected ones).
With --sampling logprobs / penalties / steer the requests also ask for top-5 logprobs, frequency and presence
penalties, or a logit_bias and allowed_token_ids: the sampler's extra work a step, which the overlap schedule
still hides behind the device (session 41). With --sampling grammar each request follows a grammar (structured
outputs: an open JSON string, so that it never completes): its mask needs the token in flight, so under the
overlap schedule the next forward is launched before that token lands and the sampler after it; the cost of
structured outputs a step.
With --profile, each point's replayed step is also broken down by kernel (torch.profiler over a few replays):
the kernels' summed time against the replay's, their count, and the kernels that took the most time, each
with its share of the step and a category (KDA, MoE, MLA, DSA, matmul, ...): where the step's time goes; and the
step's launches against its bytes: the kernel count times the cost of one dependent launch measured in the same
run (`roofline.measure_launch_floor`), beside the bytes' time at the copy rate; and `Engine.step()` under
cProfile (`profile_host`): where the host's time a step goes (the sampler's, the grammar's, the wait for the
device), which the replay's kernels do not show.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from kestrel.bench.roofline import (
    device_name,
    launch_floor_share,
    measure_ceilings,
    measure_launch_floor,
    require_cuda,
    synchronize,
    time_ms,
)
from kestrel.config import MOE, EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.request import Request, Status
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model, model_config
from kestrel.serve.env_report import report_or_error
from kestrel.utils.errors import ConfigError, KestrelError
from kestrel.utils.paths import check_writable


def step_bytes(
    model: KimiForCausalLM, batch: int, context: int, dense: bool = False, index_fp8: bool = False
) -> dict:
    """Bytes one decode step must move, by part (model-spec sizes, bf16 weights and cache, fp32 KDA state;
    indexer keys of DI bytes + a 4-byte scale each with `index_fp8`)."""
    c = model.config
    elt = model.lm_head.weight.element_size()
    weights = experts = 0
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight":
            weights += batch * p.shape[1] * p.element_size()  # only the rows looked up
        elif ".experts." in name:
            experts += p.numel() * p.element_size()
        else:
            weights += p.numel() * p.element_size()
    moe_layers = sum(t == MOE for t in c.mlp_types)
    if moe_layers:
        hit = c.num_experts * (1 - (1 - c.num_experts_per_token / c.num_experts) ** batch)
        experts = experts * hit / c.num_experts
    state = (
        len(c.kda_layer_ids)
        * batch
        * 2
        * (c.kda_num_heads * c.kda_head_dim**2 * 4 + 3 * c.kda_proj_dim * (c.kda_conv_size - 1) * elt)
    )
    read = context if dense or not c.use_dsa else min(context, c.index_topk)
    kv = len(c.mla_layer_ids) * batch * read * c.kv_cache_dim * elt
    key_bytes = c.index_head_dim + 4 if index_fp8 else c.index_head_dim * elt
    index = 0 if dense or not c.use_dsa else len(c.mla_layer_ids) * batch * context * key_bytes
    parts = {"weights": weights, "experts": experts, "kda_state": state, "mla_kv": kv, "indexer_keys": index}
    parts["total"] = sum(parts.values())
    return parts


# what the benchmark's requests ask beside greedy decoding (`--sampling`): each makes the sampler do more a step,
# and under the overlap schedule it still runs ahead of the host
SAMPLING = {
    "greedy": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5},
    # a logit_bias on 64 tokens and 256 tokens allowed (the vocabulary's first ids; tiny has 261): the steering
    "steer": {"logit_bias": {t: -1.0 for t in range(64)}, "allowed_token_ids": list(range(256))},
    "grammar": {},  # (the grammar is set on the request: GRAMMAR)
}
# --sampling grammar's language: an open JSON string, which nearly every token continues and none completes
# (SamplingParams refuses a grammar with ignore_eos, which the benchmark's requests need to run their steps)
GRAMMAR = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*'


def place_in_decode(
    engine: Engine, batch: int, context: int, steps: int, seed: int = 0, sampling: str = "greedy"
) -> list[Request]:
    """`batch` requests that have `context` tokens cached and are ready to decode `steps` tokens, greedy, with what
    SAMPLING[sampling] adds."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    reqs = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
        req = Request(
            f"bench-{seed}-{i}",
            prompt,
            SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, **SAMPLING[sampling]),
            seed,
            context + steps + 8,
        )
        need = engine.kv_pool.pages_for(context + steps + 8)
        if need > engine.runner.max_pages:
            raise RuntimeError(
                f"{context + steps + 8} tokens need {need} pages; the engine's limit is {engine.runner.max_pages}"
            )
        req.slot = engine.state_pool.alloc()
        req.pages = engine.kv_pool.alloc(need)
        if req.slot is None or req.pages is None:
            raise RuntimeError(f"the pools cannot hold {batch} requests of {context} tokens")
        if sampling == "grammar":
            req.grammar = engine.grammars.get(GRAMMAR)
            req.grammar_state = req.grammar.start
        req.output_ids = [int(prompt[-1])]
        req.num_computed = context
        req.status = Status.RUNNING
        engine.requests[req.request_id] = req
        engine.scheduler.running.append(req)
        reqs.append(req)
    return reqs


# kernel name fragments -> category, the first match wins (our Triton kernels' names, fla-core's, cuBLAS's and
# torch's; approximate: `_combine_kernel` is MLA's split-K combine, the MoE's is `_moe_combine_kernel`)
CATEGORIES = (
    ("moe", ("gate_up", "_down_kernel", "router", "expert", "moe", "grouped")),
    ("norm / activation / mix", ("rms_norm", "_mix_kernel", "glu", "sigmoid_gate", "norm", "silu")),
    ("kda", ("kda", "recurrent", "conv", "_gate_kernel")),
    ("dsa top-k", ("topk", "_select")),
    ("dsa scores", ("indexer",)),
    ("mla", ("_decode_kernel", "_combine_kernel", "mla", "flash", "attn")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul")),
    ("copy / elementwise", ("copy", "elementwise", "fill", "cat", "index", "scatter", "gather", "reduce")),
)


def _category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def profile_replay(replay, reps: int = 5, top: int = 20) -> dict:
    """The kernels of `reps` back-to-back graph replays under torch.profiler: per step, their count and summed
    time against the profiled replays' own time (CUDA events around them), the time by category, and the `top`
    kernels. The shared experts run on a side stream, beside the routed ones: kernel times that overlap are
    each counted, so the summed time can exceed the step's (busy_share > 1); under 1, the rest is the GPU
    idling between kernels. With programmatic dependent launch (kestrel.ops.pdl, on by default on Hopper) a
    kernel starts while the one before it ends and its span includes its wait for it (mini's batch-1 step summed
    323% of its replay, session 23): for each kernel's own time, profile with KESTREL_PDL=off. That also
    changes the kernels: without PDL the projections up to 16 rows take cuBLAS instead of our GEMV
    (kestrel.ops.linear), so the matmul rows of such a profile are cuBLAS's (session 45)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(reps):
            replay()
        end.record()
        torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / reps  # the profiled replays' own time a step
    kernels = [  # per step, the most time first
        {
            "name": e.key[:120],
            "category": _category(e.key),
            "ms_per_step": e.device_time_total / 1e3 / reps,
            "calls_per_step": e.count / reps,
            "share_of_replay": e.device_time_total / 1e3 / reps / replay_ms,
        }
        for e in sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
        if e.device_type == DeviceType.CUDA and e.device_time_total > 0
    ]
    total_ms = sum(k["ms_per_step"] for k in kernels)
    by_cat: dict[str, float] = {}
    for k in kernels:
        by_cat[k["category"]] = by_cat.get(k["category"], 0.0) + k["ms_per_step"]
    return {
        "replays": reps,
        "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
        "kernel_ms_per_step": total_ms,
        "profiled_replay_ms": replay_ms,
        "busy_share": total_ms / replay_ms,
        "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels": kernels[:top],
    }


def profile_host(step, steps: int, top: int = 15) -> dict:
    """`steps` calls of `step` (Engine.step) under cProfile: per step, the host's wall time and the functions that
    took the most of it, by their own time (`tottime`: a device wait is counted in the function that waits, such
    as `Event.synchronize` or `Tensor.tolist`) and by the time under them (`cumtime`). cProfile's own cost
    inflates Python-heavy functions (a few us a call): compare these shares, not their sum, with the timed step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    wall_ms = 1000 * (time.perf_counter() - start) / steps
    # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    stats = pstats.Stats(prof).stats

    def rows(col: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][col])[:top]
        return [
            {
                "function": f"{Path(f).name}:{line}({name})" if line else name,
                "calls_per_step": calls / steps,
                "own_ms_per_step": 1000 * tt / steps,
                "under_ms_per_step": 1000 * ct / steps,
            }
            for (f, line, name), (_, calls, tt, ct, _) in ranked
        ]

    return {"steps": steps, "wall_ms_per_step": wall_ms, "by_own_time": rows(2), "by_time_under": rows(3)}


def _print_profile(prof: dict, floor: dict | None = None) -> None:
    busy = prof["busy_share"]
    print(
        f"  kernels: {prof['kernels_per_step']:.0f} a step, {prof['kernel_ms_per_step']:.2f} ms of "
        f"{prof['profiled_replay_ms']:.2f} ms replayed ({busy:.0%}: summed, overlaps counted); by category: "
        + ", ".join(f"{cat} {ms:.2f}" for cat, ms in prof["by_category_ms"].items()),
        flush=True,
    )
    if floor:
        print(
            f"  launches: {floor['kernels']:.0f} x {floor['floor_us']:.2f} us = {floor['launches_ms']:.3f} ms a step "
            f"beside {floor['bytes_ms_at_copy']:.3f} ms of bytes at the copy rate (MBU {floor['mbu_if_added']:.0%} "
            "if the two added up)",
            flush=True,
        )
    for k in prof["top_kernels"][:10]:
        print(
            f"    {k['ms_per_step']:6.3f} ms {k['share_of_replay']:5.1%} x{k['calls_per_step']:4.0f}  "
            f"[{k['category']}] {k['name'][:90]}",
            flush=True,
        )


def _time_decode(
    engine: Engine,
    b: int,
    context: int,
    steps: int,
    dense: bool,
    ceilings: dict,
    profile: bool = False,
    sampling: str = "greedy",
) -> dict:
    """One (batch, mode) point: the step through Engine.step() (host-timed, everything a user gets), under the
    engine's overlap schedule and then with it off (each step read back before the next is launched), and the
    bare CUDA-graph replay (GPU-timed)."""
    reqs = place_in_decode(engine, b, context, 2 * steps + 8, sampling=sampling)
    step_ms, configured = {}, engine.overlap
    # --sampling grammar: the grammar states met for the first time inside each timed pass, each a walk over the
    # vocabulary and an upload (session 73's two runs at batch 1 differed by 1 ms a step, unexplained)
    grammar, new_states = reqs[0].grammar, {}
    for overlap in (True, False):
        engine.overlap = overlap
        for _ in range(3):
            engine.step()
        synchronize(engine.device)
        known = grammar.num_masks_made if grammar is not None else 0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
        step_ms[overlap] = 1000 * (time.perf_counter() - start) / steps
        new_states[overlap] = grammar.num_masks_made - known if grammar is not None else None
    engine.overlap = configured
    # (the requests' max_tokens is 2 * steps + 16 and 2 * steps + 6 steps ran above: 8 more fit)
    host = profile_host(engine.step, min(steps, 8)) if profile else None
    synchronize(engine.device)
    step_ms, plain_ms = step_ms[True], step_ms[False]
    runner, replay_ms, width = engine.runner, None, None
    if runner.use_cuda_graph and b <= runner.graph_sizes[-1]:
        runner._replay(reqs)  # load this batch into the graph's inputs once; then time the replay alone
        key = runner.graph_key(reqs)
        replay_ms = time_ms(runner.graphs[key].replay, warmup_ms=10, rep_ms=50)
        width = key[0] * engine.kv_pool.page_size
    parts = step_bytes(engine.model, b, context, dense, engine.kv_pool.index_fp8)
    copy = ceilings["copy_TBps"] * 1e12
    run = {
        "batch": b,
        "context": context,
        "max_model_len": engine.plan.max_model_len,
        "short_graph_len": engine.config.cuda_graph_short_len,
        "graph_width": width,  # tokens: the page table of the graph replayed (None: no graph)
        "attention": "dense MLA" if dense else "DSA",
        "sampling": sampling,
        "index_keys": "fp8" if engine.kv_pool.index_fp8 else "bf16",
        "step_ms": step_ms,
        "step_ms_no_overlap": plain_ms,
        "graph_replay_ms": replay_ms,
        "tokens_per_s": b / (step_ms * 1e-3),
        "bytes": parts,
        "mbu": parts["total"] / (step_ms * 1e-3) / copy,
        "mbu_graph_replay": parts["total"] / (replay_ms * 1e-3) / copy if replay_ms else None,
    }
    if grammar is not None:
        run["grammar_new_states"] = {"overlap": new_states[True], "no_overlap": new_states[False]}
    if engine.device.type == "cuda":
        from kestrel.ops.moe.triton_decode import barrier_gave_up

        # the one-launch MoE's grid barrier gave up during this point: its tokens are wrong
        run["moe_barrier_gave_up"] = barrier_gave_up(engine.device)
    if host is not None:
        run["host_profile"] = host
    if profile and replay_ms:
        run["profile"] = profile_replay(runner.graphs[key].replay)
        if ceilings.get("launch_floor_us"):
            run["launch_floor"] = launch_floor_share(
                run["profile"]["kernels_per_step"],
                ceilings["launch_floor_us"],
                parts["total"],
                ceilings["copy_TBps"],
            )
    print(
        f"decode b={b:4d} ctx={context:6d} (max {run['max_model_len']}, graph {width}) {run['attention']:9s} "
        f"step {step_ms:7.2f} ms "
        f"(no overlap {plain_ms:6.2f}, replay {replay_ms or float('nan'):6.2f} ms)  "
        f"{run['tokens_per_s']:9.0f} tok/s  MBU {run['mbu']:5.1%}",
        flush=True,
    )
    if run.get("moe_barrier_gave_up"):
        print(
            "WARNING: the one-launch MoE's grid barrier gave up during this point (a grid not all resident)"
        )
    if "profile" in run:
        _print_profile(run["profile"], run.get("launch_floor"))
    if host is not None:
        print(f"  host (cProfile, {host['wall_ms_per_step']:.2f} ms a step with its cost), own time a step:")
        for f in host["by_own_time"][:8]:
            print(f"    {f['own_ms_per_step']:6.3f} ms x{f['calls_per_step']:5.1f}  {f['function'][:90]}")
    for r in reqs:
        engine.abort(r.request_id)
    engine.step()
    return run


@torch.no_grad()
def fill_pools(engine: Engine) -> None:
    for t in (*engine.kv_pool.kv.values(), *engine.kv_pool.index_k.values()):
        # a slice at a time: an fp32 copy of a whole pool does not fit beside the pools (the pools take what
        # memory the plan leaves, and at a long limit the plan leaves less)
        for part in t.view(-1).split(1 << 26):
            part.copy_((torch.randn(part.shape, device=t.device) * 0.5).to(t.dtype))  # FP8 has no normal_()
    for t in engine.state_pool.ssm.values():
        t.normal_(0, 0.05)


def decode_bench(
    model: str = "mini",
    batches: tuple[int, ...] = (1, 64, 256),
    contexts: tuple[int, ...] = (4096,),
    steps: int = 24,
    dense_contrast: bool = True,
    index_key_dtype: str = "auto",
    device: str = "cuda",
    profile: bool = False,
    sampling: str = "greedy",
    max_model_len: int | None = None,
    short_graph_len: int = EngineConfig.cuda_graph_short_len,
) -> dict:
    """On CUDA, or on the CPU at small sizes (the smoke run of scripts/gpu_suite.py: no graph replay).
    `max_model_len`: the engine's context limit at every point (None: each context + steps + 64, the least that
    holds its requests). A server's default is the model's own, and decode's graphs, their page tables and the
    indexer's scores, are as wide as the limit: this measures a short context on such an engine. `short_graph_len`:
    the engine's `cuda_graph_short_len` (0: graphs of the whole limit only); each run records its graph's width."""
    # a request holds context + steps + 64 tokens: stay inside the model's position limit. Checked for every point
    # before any runs (a limit too short for the second context raised after the first had run, a traceback)
    room = model_config(model).max_position_embeddings - steps - 64
    if room < 1:
        raise ConfigError(
            f"--steps {steps} leaves no room for a context in {model}'s limit: give fewer steps"
        )
    need = min(max(contexts), room) + steps + 64
    if max_model_len is not None and max_model_len < need:
        raise ConfigError(
            f"--max-model-len {max_model_len} cannot hold a request of context {need - steps - 64} and {steps} "
            f"steps: give at least {need}, or leave it out"
        )
    if torch.device(device).type == "cuda":
        require_cuda("kestrel bench decode")
    ceilings = measure_ceilings(device)
    if profile:
        ceilings["launch_floor_us"] = measure_launch_floor(device)
    net = build_model(model, dtype=torch.bfloat16, device=device, seed=0, init_on_device=True)
    max_batch = max(batches)
    runs, engines = [], []
    for asked in contexts:
        context = min(asked, room)
        batch_sizes = [b for b in batches if b * (context + steps + 64) <= 4 * 1024 * 1024] or [1]
        cfg = EngineConfig(
            model=model,
            max_running_requests=max(batch_sizes),
            max_model_len=max_model_len or context + steps + 64,
            enable_prefix_cache=False,
            cuda_graph_max_bs=max(batch_sizes),
            index_key_dtype=index_key_dtype,
            cuda_graph_short_len=short_graph_len,
        )
        start = time.perf_counter()
        engine = Engine(cfg, model=net)  # plans and allocates the pools, captures the decode graphs
        synchronize(device)
        engines.append(
            {
                "context": context,
                "max_model_len": engine.plan.max_model_len,
                "short_graph_len": short_graph_len,
                "setup_s": time.perf_counter() - start,
                "decode_graphs": len(engine.runner.graphs),
                "graph_gib": engine.runner.graph_bytes / 2**30,  # what their capture kept reserved
                # tokens: the page tables of the captured graphs (a short width only where the limit allows it)
                "graph_widths": [w * engine.kv_pool.page_size for w in engine.runner.widths]
                if engine.runner.graphs
                else [],
            }
        )
        print(f"engine: ctx={context} max {engine.plan.max_model_len}: {engines[-1]}", flush=True)
        fill_pools(engine)
        modes = [False, True] if dense_contrast and net.config.use_dsa else [False]
        for dense in modes:  # outside: each switch recaptures the decode graphs
            engine.set_dense_attention(dense)
            for b in batch_sizes:
                runs.append(_time_decode(engine, b, context, steps, dense, ceilings, profile, sampling))
        engine.set_dense_attention(False)
        engine = None  # noqa: F841 - free its pools before the next context
        torch.cuda.empty_cache()
    return {
        "benchmark": "decode",
        "model": model,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device_name(device),
        "ceilings": ceilings,
        "max_batch": max_batch,
        "steps": steps,
        "engines": engines,  # each context's engine: its start's seconds (the graphs' capture included)
        "runs": runs,
        "env": report_or_error(str(device)),  # the versions, the fast paths selected, every variable
    }


def cmd_bench_decode(args) -> int:
    if args.out is not None and args.out.suffix == ".png":  # the PNG drawn beside would replace the JSON
        raise KestrelError(f"--out {args.out}: give the JSON's name; the PNG is drawn beside it")
    check_writable(args.out, "--out")  # before the run, not after it
    result = decode_bench(
        args.model,
        tuple(args.batches),
        tuple(args.contexts),
        args.steps,
        not args.no_dense,
        args.index_key_dtype,
        profile=args.profile,
        sampling=args.sampling,
        max_model_len=args.max_model_len,
        short_graph_len=args.cuda_graph_short_len,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        try:
            from kestrel.bench.decode_plot import plot_decode

            print(f"wrote {args.out} and {plot_decode(result, Path(args.out).with_suffix('.png'))}")
        except ImportError:
            print(
                f"wrote {args.out} (no matplotlib here: `kestrel bench plot-decode {args.out}` draws it elsewhere)"
            )
    return 0
