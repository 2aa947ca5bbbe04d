"""The one GPU script: correctness checks and measurements on the H200, JSON under $OUT.

Run on the device machine (wheels from scripts/fetch_wheels.sh carried as .whl):
    python3 scripts/gpu_suite.py --sections foundation --out $OUT
Each section appends its figures to <out>/gpu_suite.json; the session copies that file to bench/results/.
Smoke run, anywhere (CI: tests/test_gpu_suite_smoke.py): every section's code on the CPU at tiny sizes, so
that a Python error shows up before it costs GPU minutes; the figures mean nothing:
    python3 scripts/gpu_suite.py --smoke --sections all --out /tmp/smoke
Sections:
  ceilings    device-to-device copy bandwidth and 8192^3 bf16 matmul rate (the roofline of this run)
  parity      fla-core fast path vs the reference path, logits (--parity-models: tiny, mini, checkpoints;
              --parity-init: the presets' random-weight scheme, upstream or conditioned)
  parity_floor  bf16 vs fp32 of the reference and the fast path, both init schemes, cuBLAS bf16 reductions on and
              off, and the same weights on the CPU (where the bf16 error comes from)
  foundation  parity, then `generate` on mini (API and CLI)
  kda_layers  each KDA layer, fast vs reference on the same input (the kernels' error, no compounding)
  gpu_tests   every op test on the device (kernels vs references, fla-core gradients, graphs), HiCache and
              the overlap schedule on CUDA (--gpu-tests-parts: a share of them, for calls too short for all)
  engine_decode  engine decode tokens/s on mini at batch 64/8/1, CUDA graphs on and off
  profile_decode where a decode step's GPU time goes (torch.profiler, top kernels)
  engine_bench   offline throughput (512 x 1K/256) and the transformers peer at batch 64
  bench_kernels  `kestrel bench kernels`: each kernel vs the ceilings of the run
  bench_decode   `kestrel bench decode`: MBU at batch 1/8/64/256, 4K and 128K contexts, DSA vs dense
  cache_targets  issue 6: TTFT with a 32K cached history, agent reuse, host tier at a 25% GPU pool
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kestrel.env import env_overrides  # noqa: E402
from kestrel.serve.env_report import report_or_error  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """The device every section runs on, and its sizes: H200 (the figures of the GPU run) or SMOKE (--smoke).
    Sections read the module's `S`."""

    device: str
    model: str  # the benchmark model: a preset, random weights
    fast_kda: str  # the KDA backend measured against the reference ("naive")
    token_ids: int  # random prompts draw ids from [3, token_ids)
    # ceilings
    copy_bytes: int
    matmul: int  # n of the n^3 bf16 matmul
    # foundation, kda_layers
    parity_models: str  # --parity-models default
    parity_lengths: tuple[tuple[int, int], tuple[int, int]]  # (prompt tokens, decode from): mini, the others
    generate_tokens: tuple[int, int]  # generate() on `model`: prompt, new tokens
    cli_tokens: int
    kda_layer_cases: tuple[tuple[str, int], ...]  # (model, prompt tokens)
    # engine_decode, profile_decode
    decode_requests: int  # requests filled, = engine slots
    decode_batches: tuple[int, ...]
    overlap_batches: tuple[int, ...]
    decode_prompt: int
    decode_max_len: int
    decode_steps: int  # timed steps (also `bench_decode`'s)
    profile_max_len: int
    profile_steps: int
    # prefill_bench: (sequences, tokens each) packed into one engine step
    prefill_cases: tuple[tuple[int, int], ...]
    # engine_bench
    bench_requests: int  # the DSA run's; the transformers peer and kimi_linear run take bench_batch of them
    bench_batch: int
    bench_prompt: int
    bench_new_tokens: int
    # bench_kernels (None: kestrel.bench.kernels' own cases), bench_decode
    kernel_cases: dict | None
    decode_bench_batches: tuple[int, ...]
    decode_bench_fp8_batches: tuple[int, ...]
    decode_bench_contexts: tuple[int, ...]
    # bench_decode's short-context points also run on an engine of this limit (serve's default)
    decode_serve_limit: int
    decode_short_graph_len: int  # the serve-limit points again with decode graphs this wide beside
    # cache_targets
    history: int  # cached history tokens before the timed turn
    append: int  # tokens the timed turn appends
    ttft_max_len: int
    agent: dict  # the agent workload (uniform ranges as (lo, hi))
    serve_args: tuple[str, ...]
    host_gb: str  # host tier of the last configuration
    port: int  # 0: a free one
    # agent_sweep: `kestrel bench agent`'s concurrency sweep against `kestrel serve` (enough memory)
    sweep: dict
    sweep_serve_args: tuple[str, ...]


H200 = Sizes(
    device="cuda",
    model="mini",
    fast_kda="fla",
    token_ids=30000,
    copy_bytes=2 * 1024**3,
    matmul=8192,
    parity_models="tiny,mini",
    parity_lengths=((512, 496), (300, 280)),
    generate_tokens=(128, 64),
    cli_tokens=16,
    kda_layer_cases=(("tiny", 300), ("mini", 512)),
    decode_requests=256,
    decode_batches=(256, 64, 8, 1),
    overlap_batches=(64, 1),  # engine_decode: also with KESTREL_MOE_OVERLAP_SHARED=0
    decode_prompt=512,
    decode_max_len=4096,  # a page table wider than index_topk (2048): decode runs the indexer and sparse kernels
    decode_steps=24,
    profile_max_len=1024,
    profile_steps=5,
    prefill_cases=((8, 4096), (1, 32768)),
    bench_requests=512,
    bench_batch=64,
    bench_prompt=1024,
    bench_new_tokens=256,
    kernel_cases=None,
    decode_bench_batches=(1, 8, 64, 256),
    decode_bench_fp8_batches=(1, 8),
    decode_bench_contexts=(4096, 131072),
    decode_serve_limit=131072,
    decode_short_graph_len=8192,
    history=32768,
    append=500,
    ttft_max_len=40000,
    agent={
        "concurrency": 8,
        "turns": 4,
        "history_tokens": 8192,
        "append_tokens": (100, 2000),
        "reply_tokens": (50, 200),
        "think_time_s": (0, 0.5),
    },
    serve_args=("--max-running-requests", "16", "--max-model-len", "20000"),
    host_gb="16",
    port=0,  # a free port each time: two suites side by side (scripts/gpu_pair.sh) must not share a server
    sweep={
        "concurrency": (1, 4, 16, 64, 256),
        "turns": 3,
        "history_tokens": 8192,
        "append_tokens": (100, 2000),
        "reply_tokens": (50, 500),
        "think_time_s": (0, 1.0),
    },
    sweep_serve_args=("--max-running-requests", "256", "--max-model-len", "16384"),
)

# The same code paths on the CPU: the tiny preset (the trained demo checkpoint for parity: its held-out prompts),
# reference KDA and torch attention, tiny kernel shapes in Triton's interpreter, a few requests and steps. Left
# out, with a "skipped" note in the section's JSON: CUDA graphs, and running (not collecting) the op tests.
SMOKE = Sizes(
    device="cpu",
    model="tiny",
    fast_kda="naive",
    token_ids=256,
    copy_bytes=16 * 1024**2,
    matmul=256,
    parity_models="tiny,kestrel-demo",
    parity_lengths=((64, 56), (64, 56)),
    generate_tokens=(16, 8),
    cli_tokens=4,
    kda_layer_cases=(("tiny", 64),),
    decode_requests=4,
    decode_batches=(4, 2, 1),
    overlap_batches=(),
    decode_prompt=64,
    decode_max_len=512,
    decode_steps=4,
    profile_max_len=512,
    profile_steps=2,
    prefill_cases=((2, 64), (1, 128)),
    bench_requests=8,
    bench_batch=4,
    bench_prompt=64,
    bench_new_tokens=8,
    kernel_cases={
        "topk": [{"rows": 2, "length": 48, "k": 8}, {"rows": 2, "length": 48, "k": 8, "kind": "ties"}],
        "indexer": [{"batch": 2, "context": 96, "heads": 2, "dim": 16}],
        "indexer_prefill": [{"tokens": 20, "context": 96, "heads": 2, "dim": 16, "page": 16}],
        "sparse_mla": [
            {"batch": 2, "context": 96, "k": 16, "heads": 2},
            {"batch": 1, "context": 96, "k": None, "heads": 2},
        ],
        "sparse_mla_prefill": [{"tokens": 24, "k": 12, "heads": 2, "page": 16}],
        "router": [{"tokens": 3, "experts": 8, "top_k": 2, "hidden": 64}],
        "moe": [{"tokens": 4, "experts": 8, "top_k": 2, "hidden": 64, "inter": 32}],
        "kda_decode": [{"batch": 2, "heads": 2, "dim": 16}],
        "kda_conv_prefill": [{"tokens": 40, "seqs": 3, "channels": 48, "width": 56}],
    },
    decode_bench_batches=(1, 2),
    decode_bench_fp8_batches=(1,),
    decode_bench_contexts=(64, 8192),  # past tiny's 4K positions: clamped, as 128K is on mini
    decode_serve_limit=1024,
    decode_short_graph_len=128,
    history=256,
    append=32,
    ttft_max_len=512,
    agent={
        "concurrency": 8,  # as on the GPU: the pool at 25% of the working set then holds about two sessions
        "turns": 2,
        "history_tokens": 256,
        "append_tokens": (16, 64),
        "reply_tokens": (2, 4),
        "think_time_s": (0, 0),
    },
    # bf16 as on the GPU: --kv-cache-gb is worked out in bf16 bytes
    serve_args=("--max-running-requests", "16", "--max-model-len", "1024", "--dtype", "bfloat16"),
    host_gb="0.01",
    port=0,
    sweep={
        "concurrency": (1, 2),
        "turns": 2,
        "history_tokens": 128,
        "append_tokens": (8, 16),
        "reply_tokens": (2, 4),
        "think_time_s": (0, 0),
    },
    sweep_serve_args=("--max-running-requests", "4", "--max-model-len", "1024"),
)
S = H200  # main() switches to SMOKE under --smoke
OUT = Path(os.environ.get("OUT", "."))  # --out


def _sync() -> None:
    if S.device == "cuda":
        torch.cuda.synchronize()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rel(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref, got = ref.float(), got.float()
    return {
        "max_abs_over_max": float((ref - got).abs().max() / ref.abs().max()),
        "norm_rel": float((ref - got).norm() / ref.norm()),
    }


def ceilings() -> dict:
    from kestrel.bench.roofline import time_ms

    n, m = S.copy_bytes, S.matmul  # 2 GiB buffers, 8192^3
    src = torch.randn(n // 4, device=S.device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), S.device, warmup_ms=50, rep_ms=300)
    a = torch.randn(m, m, device=S.device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=S.device, dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, S.device, warmup_ms=50, rep_ms=300)
    return {
        "copy_TBps": 2 * n / (copy_ms * 1e-3) / 1e12,
        "bf16_matmul_TFLOPs": 2 * m**3 / (mm_ms * 1e-3) / 1e12,
    }


@contextlib.contextmanager
def _path(backend: str):
    """Every op on its plain-torch reference (backend "naive") or on its fast path (the KDA backend named:
    fused Triton small ops and router, Triton or grouped MoE experts, Triton / fused attention), the
    environment restored after."""
    ref = backend == "naive"
    switches = {
        "KESTREL_KDA_BACKEND": backend,
        "KESTREL_FUSED_OPS": "off" if ref else "auto",
        "KESTREL_MOE_DECODE_KERNEL": "off" if ref else "auto",
        "KESTREL_MOE_GROUPED_MM": "off" if ref else os.environ.get("KESTREL_MOE_GROUPED_MM", "auto"),
        "KESTREL_ATTN_BACKEND": "torch" if ref else "auto",
    }
    with env_overrides(switches):
        yield


def _forward(model, ids: torch.Tensor, backend: str, replay: tuple | None = None):
    """Logits of one full forward; returns (logits fp32, (routing ids, DSA selections)) for replay."""
    from kestrel.layers.context import ForwardContext, forward_context

    ctx = ForwardContext.build([len(ids)], device=ids.device)
    ctx.routing_capture, ctx.selection_capture = {}, {}
    if replay is not None:
        ctx.routing_replay, ctx.selection_replay = replay
    with _path(backend), torch.no_grad(), forward_context(ctx):
        logits = model(ids).float()
    return logits, (ctx.routing_capture, ctx.selection_capture)


def _decode_logits(model, ids: torch.Tensor, prefill: int, backend: str, replay: tuple) -> torch.Tensor:
    """Prefill `prefill` tokens, then one token a step through the dense cache (the recurrent KDA path),
    replaying the routing and DSA selections of a full forward so that no discrete choice can flip."""
    from kestrel.layers.context import forward_context
    from kestrel.models.cache import DenseCache

    routing, selection = replay
    cache = DenseCache(model.config, 1, len(ids), model.lm_head.weight.dtype, S.device)
    outs = []
    bounds = [(0, prefill)] + [(t, t + 1) for t in range(prefill, len(ids))]
    with _path(backend), torch.no_grad():
        for a, b in bounds:
            ctx = cache.context([0], [b - a], S.device)
            ctx.routing_replay = {k: v[a:b] for k, v in routing.items()}
            ctx.selection_replay = {k: [v[0][a:b]] for k, v in selection.items()}
            with forward_context(ctx):
                outs.append(model(ids[a:b]).float())
            cache.commit(ctx)
    return torch.cat(outs)


PARITY_MODELS = H200.parity_models.split(",")  # --parity-models
PARITY_INIT = ["upstream"]  # --parity-init: the random-weight scheme of the presets in `parity`


def _parity_prompt(model: str, vocab: int, length: int) -> tuple[torch.Tensor, str]:
    """A trained model (a checkpoint with its tokenizer) reads held-out chat prompts, the text it knows;
    a preset's random weights read seeded random ids."""
    from kestrel.tokenizer import checkpoint_tokenizer_dir, tokenizer_for
    from kestrel.train.chat_format import prompt_ids
    from kestrel.train.data import heldout_examples

    if checkpoint_tokenizer_dir(model) is None:
        gen = torch.Generator(S.device).manual_seed(0)
        return torch.randint(0, vocab, (length,), device=S.device, generator=gen), "seeded random ids"
    tok, ids = tokenizer_for(model), []
    for index in range(length):  # held-out problems of every arithmetic family, in turn, until long enough
        family = ("gsm_symbolic", "chain_sum", "countdown", "basic_arithmetic")[index % 4]
        ids += prompt_ids(tok, heldout_examples(family, index // 4 + 1)[-1])
        if len(ids) >= length:
            break
    return torch.tensor(ids[:length], device=S.device), "held-out chat prompts, concatenated"


@contextlib.contextmanager
def _kda_prefill(form: str):
    """fla's KDA prefill in one form for the block: "chunked" (KESTREL_KDA_RECURRENT_PREFILL=0) or "recurrent"
    (the threshold above any parity prompt)."""
    with env_overrides({"KESTREL_KDA_RECURRENT_PREFILL": {"chunked": "0", "recurrent": str(1 << 30)}[form]}):
        yield


@contextlib.contextmanager
def _bf16_reductions(reduced: bool):
    """cuBLAS's bf16 GEMMs allowed (torch's default) or not to reduce partial sums in bf16, for the block."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = reduced
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved


def parity_floor() -> dict:
    """Where mini's bf16 parity error comes from, on tiny and mini, with each random-weight scheme. The same
    seeded weights and prompt as `parity`, the fp32 reference's routing and DSA choices replayed in every pass,
    each pass against the fp32 reference: the bf16 reference with cuBLAS's bf16 reductions allowed (torch's
    default) and not, the fast path both ways, and the CPU running the same weights (fp32 and bf16) as the peer
    no GPU library touches."""
    presets = ("tiny", "mini") if S is H200 else ("tiny",)
    return {p: {init: _parity_floor(p, init) for init in ("upstream", "conditioned")} for p in presets}


def _fp32_reference(preset: str, init: str, length: int) -> tuple:
    """The parity cases' start: (fp32 model, prompt ids, prompt kind, reference logits, its routing and DSA
    choices) for a preset (seeded random weights of scheme `init`) or a checkpoint folder."""
    from kestrel.models.loader import build_model

    fp32 = build_model(preset, dtype=torch.float32, device=S.device, seed=0, init=init)
    ids, prompt_kind = _parity_prompt(preset, fp32.config.vocab_size, length)
    return (fp32, ids, prompt_kind, *_forward(fp32, ids, "naive"))


def _parity_floor(preset: str, init: str) -> dict:
    from kestrel.models.loader import build_model

    length = S.parity_lengths[0][0] if preset == "mini" else S.parity_lengths[1][0]
    fp32, ids, prompt_kind, ref32, choices32 = _fp32_reference(preset, init, length)
    bf16 = build_model(
        preset, dtype=torch.bfloat16, device=S.device, seed=0, init=init
    )  # same draws, rounded
    out: dict = {"prompt_tokens": length, "prompt": prompt_kind, "vs": "reference fp32"}
    for reduced in (True, False):
        tag = "bf16_reductions_allowed" if reduced else "fp32_reductions"
        with _bf16_reductions(reduced):
            ref16 = _forward(bf16, ids, "naive", choices32)[0]
            out[f"reference_bf16_{tag}"] = _rel(ref32, ref16)
            for form in ("chunked", "recurrent"):
                with _kda_prefill(form):
                    fast16 = _forward(bf16, ids, S.fast_kda, choices32)[0]
                out[f"fla_{form}_bf16_{tag}"] = _rel(ref32, fast16)
                out[f"fla_{form}_bf16_vs_reference_bf16_{tag}"] = _rel(ref16, fast16)
        print(
            f"parity floor {preset} {init} {tag}",
            json.dumps({k: v for k, v in out.items() if tag in k}),
            flush=True,
        )
    del bf16
    if S.device == "cuda":  # the same weights on the CPU, both dtypes
        start = time.perf_counter()
        cpu_ids, cpu_choices = ids.cpu(), _to_cpu(choices32)
        model = fp32.to("cpu")  # in place: fp32, then bf16
        with env_overrides({"KESTREL_FUSED_OPS": "off"}):
            cpu_ref32 = _forward(model, cpu_ids, "naive", cpu_choices)[0]
            out["cpu_reference_fp32"] = _rel(ref32.cpu(), cpu_ref32)
            model.to(torch.bfloat16)
            out["cpu_reference_bf16_vs_cpu_reference_fp32"] = _rel(
                cpu_ref32, _forward(model, cpu_ids, "naive", cpu_choices)[0]
            )
        out["cpu_seconds"] = time.perf_counter() - start
        print(
            f"parity floor {preset} {init} cpu",
            json.dumps({k: v for k, v in out.items() if "cpu" in k}),
            flush=True,
        )
    del fp32
    if S.device == "cuda":
        torch.cuda.empty_cache()
    return out


def _to_cpu(choices: tuple) -> tuple:
    routing, selection = choices
    return (
        {k: v.cpu() for k, v in routing.items()},
        {k: [t.cpu() for t in v] for k, v in selection.items()},
    )


def parity() -> dict:
    """Fast path (fla-core KDA) against the reference path (plain-torch KDA), same bf16 weights, on every
    --parity-models entry.

    MoE routing and DSA top-k are discontinuous: on random weights, bf16 rounding alone flips some expert
    and token choices and the logits then diverge for reasons that are not the kernels. So the reference
    pass records its choices and the compared pass replays them (routing replay, as RL does), which
    isolates the numerical difference of the kernels. The fp32 reference is reported beside it.
    """
    from kestrel.models.loader import build_model
    from kestrel.presets import resolve_model

    result: dict = {"parity": {}}
    mini_lengths, other_lengths = S.parity_lengths
    cases = [(m, *(mini_lengths if m == "mini" else other_lengths)) for m in PARITY_MODELS]
    for preset, length, decode_from in cases:  # a preset (seeded random weights) or a checkpoint folder
        fp32, ids, prompt_kind, ref32, choices32 = _fp32_reference(preset, PARITY_INIT[0], length)
        # the same comparison without bf16: what is left is the kernels' own rounding (fla's and our Triton
        # kernels may run fp32 products as tf32 on tensor cores), not the weights' and activations' bf16
        # fla's prefill has two forms (KESTREL_KDA_RECURRENT_PREFILL): the chunked kernels, and for a short
        # step the recurrent one; the parity prompts are short enough for either, so both are compared
        with _kda_prefill("chunked"):
            fast32, _ = _forward(fp32, ids, S.fast_kda, replay=choices32)
        with _kda_prefill("recurrent"):
            fast32_rec, _ = _forward(fp32, ids, S.fast_kda, replay=choices32)
        del fp32
        bf16 = build_model(preset, dtype=torch.bfloat16, device=S.device, seed=0, init=PARITY_INIT[0])
        ref16, choices16 = _forward(bf16, ids, "naive")
        with _kda_prefill("recurrent"):
            fast16_rec, _ = _forward(bf16, ids, S.fast_kda, replay=choices16)
        with _kda_prefill("chunked"):
            fast16, _ = _forward(bf16, ids, S.fast_kda, replay=choices16)
            fast16_free, _ = _forward(bf16, ids, S.fast_kda)
            decode = _decode_logits(bf16, ids, decode_from, S.fast_kda, choices16)
        entry = {
            "prompt_tokens": length,
            "prompt": prompt_kind,
            "init": "checkpoint" if Path(resolve_model(preset)).exists() else PARITY_INIT[0],
            "layers": bf16.config.layer_pattern,
            "target": "fla bf16 vs reference bf16 <= 2e-2",
            "fla_bf16_vs_reference_bf16": _rel(ref16, fast16),
            "fla_fp32_vs_reference_fp32": _rel(ref32, fast32),
            "fla_recurrent_prefill_bf16_vs_reference_bf16": _rel(ref16, fast16_rec),
            "fla_recurrent_prefill_fp32_vs_reference_fp32": _rel(ref32, fast32_rec),
            "fla_bf16_prefill_then_decode_vs_reference_bf16": _rel(ref16, decode),
            "fla_bf16_vs_reference_bf16_without_replay": _rel(ref16, fast16_free),
            "reference_bf16_vs_reference_fp32_replayed": _rel(
                ref32, _forward(bf16, ids, "naive", choices32)[0]
            ),
            "reference_bf16_vs_reference_fp32_without_replay": _rel(ref32, ref16),
        }
        result["parity"][preset] = entry
        print(preset, json.dumps(entry), flush=True)
        del bf16
        torch.cuda.empty_cache()
    return result


def foundation() -> dict:
    """`parity`, then the reference generate() and the `kestrel generate` CLI on the benchmark model."""
    from kestrel.models.generate import generate
    from kestrel.models.loader import build_model

    result = parity()
    os.environ["KESTREL_KDA_BACKEND"] = S.fast_kda
    model = build_model(S.model, dtype=torch.bfloat16, device=S.device, seed=0)
    prompt_len, new_tokens = S.generate_tokens
    prompt = list(range(3, 3 + prompt_len))
    generate(model, prompt, 4)  # warm-up: Triton compilation
    _sync()
    start = time.perf_counter()
    out = generate(model, prompt, new_tokens)
    _sync()
    elapsed = time.perf_counter() - start
    result[f"generate_{S.model}"] = {
        "prompt_tokens": len(prompt),
        "new_tokens": len(out),
        "seconds": elapsed,
        "tokens_per_s": len(out) / elapsed,
        "note": "reference generate(): one request, dense cache, per-sequence Python loops, no CUDA graphs",
    }
    print(f"generate_{S.model}", json.dumps(result[f"generate_{S.model}"]), flush=True)

    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "kestrel.serve.cli",
            "generate",
            "--model",
            S.model,
            "--prompt",
            "Kestrel on an H200",
            "--max-new-tokens",
            str(S.cli_tokens),
        ],
        capture_output=True,
        text=True,
    )
    result[f"cli_generate_{S.model}"] = {
        "returncode": cli.returncode,
        "stderr_tail": cli.stderr.strip().splitlines()[-1:],
    }
    print("cli:", result[f"cli_generate_{S.model}"], flush=True)

    return result


def kda_layers() -> dict:
    """Each KDA layer of tiny and mini, fast path vs reference on the SAME bf16 input (teacher forcing):
    the kernels' own error, without the compounding of bf16 rounding through the stack."""
    from kestrel.layers.context import ForwardContext, forward_context
    from kestrel.layers.kda import KimiDeltaAttention
    from kestrel.models.loader import build_model

    result = {}
    for preset, length in S.kda_layer_cases:
        model = build_model(preset, dtype=torch.bfloat16, device=S.device, seed=0)
        ids = torch.randint(
            0,
            model.config.vocab_size,
            (length,),
            device=S.device,
            generator=torch.Generator(S.device).manual_seed(0),
        )
        inputs = {}
        hooks = [
            m.register_forward_hook(
                lambda mod, inp, out, store=inputs: store.__setitem__(mod.layer_id, inp[0])
            )
            for m in model.modules()
            if isinstance(m, KimiDeltaAttention)
        ]
        _forward(model, ids, "naive")
        for h in hooks:
            h.remove()
        errors = {}
        for layer_id, x in sorted(inputs.items()):
            layer = model.model.layers[layer_id].self_attn
            outs = {}
            for backend in ("naive", S.fast_kda):
                ctx = ForwardContext.build([length], device=S.device)
                with _path(backend), torch.no_grad(), forward_context(ctx):
                    outs[backend] = layer(x).float()
            errors[layer_id] = _rel(outs["naive"], outs[S.fast_kda])
        worst = max(e["norm_rel"] for e in errors.values())
        result[preset] = {"per_layer": errors, "worst_norm_rel": worst, "target": "<= 2e-2"}
        print(preset, "worst per-layer KDA norm_rel", worst, flush=True)
        del model
        torch.cuda.empty_cache()
    return result


def _mini_engine(fmt: str, max_running: int, max_len: int, graphs: bool = True):
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.models.kimi import KimiForCausalLM
    from kestrel.models.loader import init_random_weights
    from kestrel.presets import preset_config

    os.environ["KESTREL_KDA_BACKEND"] = S.fast_kda
    with torch.device(S.device):
        model = KimiForCausalLM(preset_config(S.model, fmt), torch.bfloat16)
    init_random_weights(model, seed=0, rng_device=S.device)
    cfg = EngineConfig(
        model=S.model,
        max_running_requests=max_running,
        max_model_len=max_len,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=max_running,
        chunked_prefill_size=4096,
    )
    start = time.perf_counter()
    engine = Engine(cfg, model=model)
    return engine, time.perf_counter() - start


def _fill(engine, n: int, prompt_len: int, max_tokens: int, seed: int = 0) -> None:
    from kestrel.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        ids = torch.randint(3, S.token_ids, (prompt_len,), generator=g).tolist()
        engine.add_request(
            ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), f"r{seed}-{i}"
        )


def _step_rate(seconds: float, tokens: int) -> dict:
    """`S.decode_steps` timed steps as ms a step and tokens/s."""
    return {"step_ms": 1000 * seconds / S.decode_steps, "tokens_per_s": tokens / seconds}


def _timed_steps(engine, steps: int) -> tuple[float, int]:
    _sync()
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    _sync()
    return time.perf_counter() - start, tokens


def _probe_grouped_mm() -> str:
    """Use torch._grouped_mm only if it runs and agrees with the reference here."""
    from kestrel.ops.moe import moe_experts, moe_experts_grouped

    try:
        x = torch.randn(40, 256, device=S.device, dtype=torch.bfloat16)
        w13 = torch.randn(8, 128, 256, device=S.device, dtype=torch.bfloat16) * 0.05
        w2 = torch.randn(8, 256, 64, device=S.device, dtype=torch.bfloat16) * 0.05
        ids = torch.randint(0, 8, (40, 2), device=S.device)
        w = torch.rand(40, 2, device=S.device)
        a = moe_experts_grouped(x, w13, w2, w, ids, "silu", use_grouped_mm=True)
        b = moe_experts(x, w13, w2, w, ids, "silu")
        _sync()
        ok = float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2
        return "auto" if ok else "off"
    except Exception as e:  # noqa: BLE001
        print("grouped_mm probe failed:", repr(e)[:300], flush=True)
        return "off"


def _graph_matches_eager(engine) -> bool:
    """A replayed decode graph computes exactly what the eager batched path computes on the same padded
    inputs. Both passes advance the KDA states of the rows, so the states are snapshot and restored."""
    runner, pool = engine.runner, engine.state_pool
    reqs = [r for r in engine.scheduler.running if r.in_decode][:3]
    if not reqs or not runner.use_cuda_graph:
        return False
    width, bs = runner.graph_key(reqs)
    slots = torch.tensor([r.slot for r in reqs], device="cuda")
    saved = {k: (pool.ssm[k][slots].clone(), pool.conv[k][slots].clone()) for k in pool.ssm}
    logits, argmax = runner._replay(reqs)
    replayed, replayed_argmax = logits[: len(reqs)].clone(), argmax[: len(reqs)].clone()
    for k, (ssm, conv) in saved.items():
        pool.ssm[k][slots], pool.conv[k][slots] = ssm, conv
    inputs = [t.to("cuda") for t in runner._decode_inputs(reqs, width, bs)]
    with torch.no_grad():
        eager = runner._decode_forward(*inputs)[: len(reqs)]
    for k, (ssm, conv) in saved.items():
        pool.ssm[k][slots], pool.conv[k][slots] = ssm, conv
    return bool(torch.equal(replayed, eager) and torch.equal(replayed_argmax, eager.argmax(-1)))


def engine_decode() -> dict:
    """Decode tokens/s of the engine on mini (random bf16 weights, DSA on) at batch 256, 64, 8, 1, CUDA graphs
    on and off, prompts of 512 tokens; plus a graph-vs-eager token check."""
    os.environ["KESTREL_MOE_GROUPED_MM"] = _probe_grouped_mm()
    engine, setup_s = _mini_engine("kimi_k3", S.decode_requests, S.decode_max_len)
    result: dict = {
        "moe_grouped_mm": os.environ["KESTREL_MOE_GROUPED_MM"],
        "setup_s_including_graph_capture": setup_s,
        "plan": engine.plan.describe(),
        "batches": {},
    }
    _fill(engine, S.decode_requests, S.decode_prompt, 400)
    start = time.perf_counter()
    while any(not r.in_decode for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    _sync()
    result[f"prefill_{S.decode_requests}x{S.decode_prompt}_s"] = time.perf_counter() - start
    graph_modes = (True, False) if engine.runner.use_cuda_graph else (False,)
    for batch in S.decode_batches:
        for r in list(engine.scheduler.running)[batch:]:
            engine.abort(r.request_id)
        engine.step()  # drain aborts (and one step of the new batch)
        entry = {}
        for graphs in graph_modes:
            engine.runner.use_cuda_graph = graphs
            _timed_steps(engine, 3)  # warm up
            seconds, tokens = _timed_steps(engine, S.decode_steps)
            entry["graphs_on" if graphs else "graphs_off"] = _step_rate(seconds, tokens)
        engine.runner.use_cuda_graph = graph_modes[0]
        if graph_modes[0] and batch in S.overlap_batches:  # the shared experts in line (the default: a side
            # stream), graphs again
            with env_overrides({"KESTREL_MOE_OVERLAP_SHARED": "0"}):
                engine.runner.recapture_graphs()
                _timed_steps(engine, 3)
                seconds, tokens = _timed_steps(engine, S.decode_steps)
            engine.runner.recapture_graphs()
            entry["graphs_on_shared_experts_in_line"] = _step_rate(seconds, tokens)
            # graphs on again, right after: the contexts grew during the runs above, so this is its peer
            _timed_steps(engine, 3)
            seconds, tokens = _timed_steps(engine, S.decode_steps)
            entry["graphs_on_again"] = _step_rate(seconds, tokens)
        result["batches"][batch] = entry
        print("decode batch", batch, json.dumps(entry), flush=True)
    if graph_modes[0]:
        result["graph_replay_equals_eager_bitwise"] = _graph_matches_eager(engine)
        print("graph replay == eager (bitwise):", result["graph_replay_equals_eager_bitwise"], flush=True)
    else:
        result["skipped"] = f"CUDA graphs (graphs_on, graph replay == eager): the engine runs on {S.device}"
    return result


def _hf_mini(path: Path):
    """transformers' KimiLinearForCausalLM (fla-core kernels) on the mini preset's kimi_linear config, random
    bf16 weights, saved to `path` so that Kestrel loads the very same checkpoint."""
    from transformers import KimiLinearConfig

    from kestrel.presets import preset_hf_config

    if S.device == "cuda":
        from transformers import KimiLinearForCausalLM
    else:  # fla-core's kernels need CUDA: transformers' own torch paths
        from tests.hf_reference import torch_only_kimi_linear

        KimiLinearForCausalLM = torch_only_kimi_linear().KimiLinearForCausalLM
    raw = preset_hf_config(S.model, "kimi_linear")
    raw.pop("model_type", None)
    cfg = KimiLinearConfig(**raw)
    with torch.device(S.device):
        model = KimiLinearForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path)
    return model


def _hf_generate_throughput(model, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = torch.tensor(prompts, device=S.device)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        model.generate(ids[:2, :64], max_new_tokens=4, do_sample=False, pad_token_id=2)  # warm-up / compile
        _sync()
        start = time.perf_counter()
        model(ids, logits_to_keep=1)  # prefill alone (last position's logits, as generate), to split it off
        _sync()
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, **gen)
        _sync()
        total_s = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "requests": len(prompts),
        "output_tokens": produced,
        "seconds": total_s,
        "prefill_s": prefill_s,
        "output_tokens_per_s": produced / total_s,
        "decode_tokens_per_s": produced / decode_s,
    }


def _kestrel_throughput(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    from kestrel.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    # Where the time goes, step by step: each step's prefill tokens and decode rows (recorded as the runner
    # gets its batch) and its wall time (a step ends when its tokens reach the host, so no extra sync; under
    # the overlap schedule a call also launches the decode step after it, whose rows it records too).
    shapes, times, forward = [], [], engine.runner.forward
    _sync()
    start, produced, first_decode = time.perf_counter(), 0, None
    try:
        engine.runner.forward = lambda batch, **ids: (
            shapes.append((sum(c.end - c.start for c in batch.prefill), len(batch.decode)))
            or forward(batch, **ids)
        )
        for i, p in enumerate(prompts):
            engine.add_request(p, params, f"t{i}-{time.perf_counter_ns()}")
        while engine.has_unfinished():
            t, n = time.perf_counter(), len(shapes)
            outs = engine.step()
            times.append(time.perf_counter() - t)
            if len(shapes) == n:  # a step that ran no forward
                shapes.append((0, 0))
            if len(shapes) > n + 1:  # the overlap schedule's first decode call: its step and the next
                shapes[n:] = [(sum(s[0] for s in shapes[n:]), max(s[1] for s in shapes[n:]))]
            produced += sum(len(o.new_token_ids) for o in outs)
            if (
                first_decode is None
                and engine.scheduler.running
                and all(r.in_decode for r in engine.scheduler.running)
                and not engine.scheduler.waiting
            ):
                _sync()
                first_decode = (time.perf_counter(), produced)
    finally:
        del engine.runner.forward  # the class's method again
    _sync()
    total = time.perf_counter() - start
    entry = {
        "requests": len(prompts),
        "output_tokens": produced,
        "seconds": total,
        "output_tokens_per_s": produced / total,
    }
    if first_decode is not None:
        t0, n0 = first_decode
        entry["decode_tokens_per_s"] = (produced - n0) / max(time.perf_counter() - t0, 1e-9)
    prefill = [(s, t) for s, t in zip(shapes, times) if s[0]]
    entry["steps"] = {
        "count": len(times),
        "with_prefill": len(prefill),
        "with_prefill_s": sum(t for _, t in prefill),
        "prefill_tokens": sum(s[0] for s, _ in prefill),
        "slowest_prefill_steps": sorted(([*s, t] for s, t in prefill), key=lambda x: -x[2])[:4],
        "decode_only_s": sum(t for s, t in zip(shapes, times) if not s[0]),
        "outside_steps_s": total - sum(times),
    }
    return entry


def engine_bench() -> dict:
    """Issue 3's benchmark: offline throughput (512 requests, 1K in / 256 out) and the transformers peer on
    the same kimi_linear checkpoint at batch 64, plus Kestrel on the full mini (DSA). Kestrel's runs go three
    times on one engine, the prefix cache flushed before each: with the overlap schedule (`_first_run`: it pays
    the first compilations of the prefill shapes the warm-up did not meet), without it (`_no_overlap`), and with
    it again (the figure without a suffix)."""
    import shutil

    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine

    os.environ["KESTREL_MOE_GROUPED_MM"] = _probe_grouped_mm()
    g = torch.Generator().manual_seed(0)
    n, batch, prompt_len, new = S.bench_requests, S.bench_batch, S.bench_prompt, S.bench_new_tokens
    prompts = [torch.randint(3, S.token_ids, (prompt_len,), generator=g).tolist() for _ in range(n)]
    path = Path(tempfile.mkdtemp(prefix=f"{S.model}-kimi-linear-"))  # removed below
    hf = _hf_mini(path)
    result: dict = {"workload": f"{prompt_len} prompt tokens, {new} new tokens, greedy, ignore EOS"}
    peer, ours = f"transformers_batch{batch}", f"kestrel_kimi_linear_batch{batch}"
    result[peer] = _hf_generate_throughput(hf, prompts[:batch], new)
    print(f"transformers b{batch}", json.dumps(result[peer]), flush=True)
    del hf
    torch.cuda.empty_cache()
    os.environ["KESTREL_KDA_BACKEND"] = S.fast_kda
    cfg = EngineConfig(
        model=str(path),
        max_running_requests=batch,
        max_model_len=prompt_len + new + 64,
        cuda_graph_max_bs=batch,
        chunked_prefill_size=8192,
        enable_prefix_cache=False,
    )
    engine = Engine(cfg)
    # warm-up at the timed run's shapes (a full prefill chunk of whole prompts, then decode), as the peer's
    # prefill-only pass warms it: a first chunk of a new length compiles and autotunes kernels
    warm = max(1, min(batch, cfg.chunked_prefill_size // prompt_len))
    _kestrel_throughput(engine, prompts[:warm], 8)
    result.update(_overlap_runs(engine, ours, prompts[:batch], new))
    ratio = result[ours]["output_tokens_per_s"] / result[peer]["output_tokens_per_s"]
    result[f"ratio_kestrel_over_transformers_batch{batch}"] = ratio
    print("ratio", ratio, flush=True)
    del engine
    shutil.rmtree(path, ignore_errors=True)
    torch.cuda.empty_cache()
    engine, _ = _mini_engine("kimi_k3", n // 2, prompt_len + new + 64)  # half of the requests at once
    _kestrel_throughput(engine, prompts[:warm], 8)
    result.update(_overlap_runs(engine, f"kestrel_{S.model}_dsa_{n}_requests", prompts, new))
    return result


def _overlap_runs(engine, name: str, prompts: list[list[int]], new: int) -> dict:
    """The throughput run with the overlap schedule (first and again) and without it, the cache flushed
    before each (the prompts would all hit it otherwise)."""
    runs = {}
    for key, overlap in ((f"{name}_first_run", True), (f"{name}_no_overlap", False), (name, True)):
        engine.overlap = overlap
        engine.flush_cache()
        runs[key] = _kestrel_throughput(engine, prompts, new)
        print(key, json.dumps(runs[key]), flush=True)
    return runs


def _profiled(fn, record_shapes: bool = False):
    """fn() under torch.profiler: (its result, the profiler, the kernels' events, their own time in us). The
    kernels themselves, not the CPU ops that launched them (which carry the same time again); on the CPU (the
    smoke run) the ops stand where the kernels would."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = S.device == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        out = fn()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind]
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    return out, prof, events, own


def profile_decode() -> dict:
    """Where a decode step's GPU time goes: torch.profiler over eager decode steps of mini at batch 64 (no
    graphs, so that kernels are attributed), top kernels by CUDA time, and the per-step totals."""

    os.environ["KESTREL_MOE_GROUPED_MM"] = _probe_grouped_mm()
    batch = min(64, S.decode_requests)
    engine, _ = _mini_engine("kimi_k3", batch, S.profile_max_len, graphs=False)
    _fill(engine, batch, S.decode_prompt, 400)
    while any(not r.in_decode for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    _timed_steps(engine, 3)
    steps = S.profile_steps
    sort_by = "self_cuda_time_total" if S.device == "cuda" else "self_cpu_time_total"
    (seconds, _), prof, events, self_us = _profiled(lambda: _timed_steps(engine, steps))
    cuda_total = sum(self_us(e) for e in events) / steps / 1000  # ms per step
    top = sorted(events, key=self_us, reverse=True)[:25]
    table = [
        {
            "name": e.key[:90],
            "ms_per_step": self_us(e) / steps / 1000,
            "calls_per_step": e.count / steps,
        }
        for e in top
    ]
    (OUT / "profile_decode.txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=60))
    result = {
        "wall_ms_per_step": 1000 * seconds / steps,
        "cuda_ms_per_step": cuda_total,
        "kernel_launches_per_step": sum(e.count for e in events) / steps,
        "top_kernels": table,
    }
    print("profile:", json.dumps({k: v for k, v in result.items() if k != "top_kernels"}), flush=True)
    for row in table[:12]:
        print(f"  {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.0f}  {row['name']}", flush=True)
    return result


def _prefill_flops_per_token(model, context: int) -> float:
    """Forward FLOPs per prefill token: 2 x the active matmul parameters (routed experts at top-k; not the
    embedding lookup, not the LM head, which prefill runs for the last position only) plus MLA attention,
    2 x (QK^T + PV) over the average causal context, dense-equivalent (DSA computes less past index_topk)."""
    c = model.config
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        active += p.numel() * (c.num_experts_per_token / c.num_experts if ".experts." in name else 1)
    heads_dim = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    return 2 * active + 2 * len(c.mla_layer_ids) * heads_dim * context / 2


def _prefill_step(engine, n: int, length: int, g: torch.Generator) -> float:
    """Seconds of the one engine step that prefills n fresh random prompts of `length` tokens (and samples
    their first tokens); the requests are then run out."""
    from kestrel.engine.sampling_params import SamplingParams

    for _ in range(n):
        prompt = torch.randint(3, S.token_ids, (length,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    _sync()
    start = time.perf_counter()
    engine.step()
    _sync()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return seconds


def prefill_bench() -> dict:
    """Issue 4's packed prefill: `n` prompts of `length` tokens in one engine step (chunked-prefill budget = all
    of them), mini with DSA, random bf16 weights. Time of the step after a warm-up of the same shapes, MFU
    against the bf16 matmul ceiling measured here, and the top kernels and ops of one profiled step of each case."""

    from kestrel.bench.profiling import ops_by_shape
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.models.loader import build_model

    os.environ["KESTREL_KDA_BACKEND"] = S.fast_kda
    os.environ["KESTREL_MOE_GROUPED_MM"] = _probe_grouped_mm()
    result: dict = {"ceilings": ceilings(), "cases": {}}
    peak = result["ceilings"]["bf16_matmul_TFLOPs"]
    net = build_model(S.model, dtype=torch.bfloat16, device=S.device, seed=0, init_on_device=True)
    g = torch.Generator().manual_seed(0)
    for n, length in S.prefill_cases:
        engine = Engine(
            EngineConfig(
                model=S.model,
                max_running_requests=n,
                max_model_len=length + 8,
                chunked_prefill_size=n * length,
                enable_prefix_cache=False,
                disable_cuda_graph=True,
            ),
            model=net,
        )

        _prefill_step(engine, n, length, g)  # compile, autotune
        seconds = min(_prefill_step(engine, n, length, g) for _ in range(2))
        tokens = n * length
        flops = _prefill_flops_per_token(net, length) * tokens
        entry = {
            "tokens": tokens,
            "step_s": seconds,
            "tokens_per_s": tokens / seconds,
            "TFLOPs": flops / seconds / 1e12,
            "mfu_of_measured_matmul": flops / seconds / 1e12 / peak,
            "flops_per_token": flops / tokens,
        }
        # the same step with each sparse-prefill kernel forced (the default, auto, weighs their pairs)
        for mode in ("rows", "expanded"):
            with env_overrides({"KESTREL_SPARSE_PREFILL": mode}):
                _prefill_step(engine, n, length, g)  # compile
                entry[f"step_s_sparse_prefill_{mode}"] = min(
                    _prefill_step(engine, n, length, g) for _ in range(2)
                )
        # one profiled step of every case (the single 32K sequence spends its time otherwise than the packed 8)
        _, prof, events, own = _profiled(functools.partial(_prefill_step, engine, n, length, g), True)
        entry["top_kernels"] = [
            {"name": e.key[:90], "ms": own(e) / 1000, "calls": e.count}
            for e in sorted(events, key=own, reverse=True)[:20]
        ]
        entry["top_ops_by_shape"] = ops_by_shape(prof, 30)
        result["cases"][f"{n}x{length}"] = entry
        print(
            f"prefill {n}x{length}",
            json.dumps({k: v for k, v in entry.items() if k != "top_kernels"}),
            flush=True,
        )
        for row in entry.get("top_kernels", [])[:10]:
            print(f"  {row['ms']:9.3f} ms  x{row['calls']:5d}  {row['name']}", flush=True)
        engine = None  # noqa: F841
        if S.device == "cuda":
            torch.cuda.empty_cache()
    return result


GPU_TEST_PARTS = ["switches", "fuse", "rest"]  # --gpu-tests-parts
GPU_TEST_WORKERS = [1]  # --gpu-tests-workers
_SWITCH_TESTS = [
    "tests/ops/test_kda.py::test_fla_chunk_gradients_match_the_reference",
    "tests/ops/test_packed_conv.py::test_fla_conv_matches_reference",
]


# The test files outside tests/ops with cases that run on CUDA alone (skipped on the CPU): `rest` runs them after
# tests/ops. tests/test_gpu_suite_smoke.py finds every such file in tests/ and checks that it is here.
_CUDA_TESTS_ELSEWHERE = (
    "tests/engine/test_dense_prefill_runs.py",
    "tests/engine/test_graph_widths.py",
    "tests/engine/test_hicache.py",
    "tests/engine/test_sampler.py",
    "tests/models/test_training_path.py",
    "tests/engine/test_prompt_logprobs.py",
    "tests/engine/test_overlap.py",
    "tests/engine/test_structured_outputs.py",
)


# The GPU-test files that build an Engine with the default memory plan (85% of the GPU's free memory for KV,
# kept in torch's cache after the test): beside other processes on the one GPU they would starve them, so with
# --gpu-tests-workers they run after the rest of their part, in one process (`worker_runs`).
_ENGINE_TEST_FILES = (
    "tests/engine/test_dense_prefill_runs.py",
    "tests/engine/test_graph_widths.py",
    "tests/engine/test_hicache.py",
    "tests/engine/test_sampler.py",
    "tests/engine/test_prompt_logprobs.py",
    "tests/engine/test_overlap.py",
    "tests/engine/test_structured_outputs.py",
)


def worker_runs(targets: list[str], workers: int) -> list[tuple[list[str], int]]:
    """A part's pytest arguments as (arguments, workers) runs: one run with `workers`, or, with more than one
    worker, the part's Engine-building files (`_ENGINE_TEST_FILES`) split off into a second run of one process
    (options such as --deselect and -m go to both runs; a run left without a file is dropped)."""
    if workers <= 1:
        return [(targets, workers)]

    def is_file(arg: str) -> bool:
        return arg.startswith("tests/")

    def engine(arg: str) -> bool:
        return arg.split("::")[0] in _ENGINE_TEST_FILES

    options = [a for a in targets if not is_file(a)]
    shared = [a for a in targets if is_file(a) and not engine(a)]
    alone = [a for a in targets if is_file(a) and engine(a)]
    runs = [(shared + options, workers), (alone + options, 1)]
    return [(run, n) for run, n in runs if any(is_file(a) for a in run)]


def gpu_test_targets(parts: list[str]) -> list[list[str]]:
    """pytest arguments for each part: `switches` (the fla-core tests that decide the training run's fast-path
    switches), `fuse` (the compiled training ops' CUDA cases; on the device machine their CPU cases, inductor's
    C++ build of a training step, ran past the 560 s the whole section had, session 42), `rest` (every other op
    test, then the CUDA cases elsewhere: `_CUDA_TESTS_ELSEWHERE`), or `rest:K/N`: the K-th of N runs of rest's
    files in that order, for calls too short for all of it (on a cold Triton cache the three parts took over
    570 s, session 45: `switches` alone 446 s), or a test file or node id under tests/ as pytest takes it (the
    few tests a session left unrun or failed)."""
    rest_files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests" / "ops").glob("test_*.py"))
    rest_files += list(_CUDA_TESTS_ELSEWHERE)
    targets = []
    for part in parts:
        if part == "switches":
            targets.append(list(_SWITCH_TESTS))
        elif part == "fuse":
            targets.append(["tests/test_fuse.py", "-m", "gpu"])
        elif share := re.fullmatch(r"rest(?::(\d+)/(\d+))?", part):
            k, n = (int(share[1]), int(share[2])) if share[1] else (1, 1)
            if not 1 <= k <= n <= len(rest_files):
                raise ValueError(
                    f"gpu tests part {part!r}: want rest:K/N with 1 <= K <= N <= {len(rest_files)}"
                )
            files = rest_files[(k - 1) * len(rest_files) // n : k * len(rest_files) // n]
            targets.append(files + [f"--deselect={t}" for t in _SWITCH_TESTS])
        elif part.startswith("tests/"):
            if not (ROOT / part.split("::")[0]).is_file():
                raise ValueError(f"gpu tests part {part!r}: no such test file")
            targets.append([part])
        else:
            raise ValueError(
                f"gpu tests part {part!r}: choose from switches, fuse, rest, rest:K/N, or a test file or node id"
            )
    return targets


def gpu_tests() -> dict:
    """Every op test on the device: the `gpu`-marked ones (mini sizes, CUDA graphs, fla-core gradients) and
    the kernel tests that run their tiny cases compiled when CUDA is there (on CPU they run interpreted);
    plus HiCache's CUDA path (pinned host tier, copy streams) and the compiled training ops. The parts of
    --gpu-tests-parts (`gpu_test_targets`) run in that order, one pytest each.

    The tests that decide the training run's fast-path switches run first, and pytest writes one line per test
    straight into $OUT/gpu_tests.log, so a call that runs out of time still returns every outcome so far (the
    first device run of this section, 2026-11-30, ran past the 400 s it was given and returned nothing).
    Pick a switch from the log: `_pytest_outcomes` reads it.

    With --gpu-tests-workers N > 1, each part runs in N pytest-xdist processes sharing the one GPU (the image has
    pytest-xdist): the section's time is mostly Triton compiling kernels on one CPU core (session 46: 1,100 s over
    three calls for 873 tests), and the machine has 16. `xdist_args` says how; the files that build an Engine
    with the default memory plan run after the rest of their part in one process (`worker_runs`).

    The smoke run only collects them (every target named here exists): on the CPU they are CI's own suite."""
    collect_only = [] if S.device == "cuda" else ["--collect-only"]
    log_path = OUT / "gpu_tests.log"
    returncodes = []
    with log_path.open("w") as log:
        workers = 1 if collect_only else GPU_TEST_WORKERS[0]
        runs = [run for targets in gpu_test_targets(GPU_TEST_PARTS) for run in worker_runs(targets, workers)]
        for targets, n in runs:
            # -v (over the project's -q): one line per test as it ends, `<node id> PASSED|FAILED|...`, so a
            # killed run's log still names every outcome so far; -rfEs: failures, errors and skip reasons at the
            # end; durations: where the time goes
            cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-v", "-rfEs", "--durations=25"]
            cmd += [*targets, "-p", "no:cacheprovider", "--tb=short", *collect_only, *xdist_args(n, log)]
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
            returncodes.append(proc.returncode)
            log.flush()
    outcomes = _pytest_outcomes(log_path.read_text())
    counts, failed = outcome_counts(outcomes)
    print("gpu tests:", returncodes, counts, *failed, sep="\n  ", flush=True)
    result = {
        "parts": list(GPU_TEST_PARTS),
        "workers": GPU_TEST_WORKERS[0],
        "returncodes": returncodes,
        "counts": counts,
        "failed": failed,
        "outcomes": outcomes,
    }
    if collect_only:
        result["skipped"] = "running the tests: on the CPU they are the CI suite itself (collected only)"
    return result


def xdist_args(workers: int, log=None) -> list[str]:
    """pytest arguments that spread a part's tests over `workers` processes (none for one worker, or where
    pytest-xdist is missing: then a line in `log` says so and the part runs in one process). Tests are dealt out
    in collection order, in one contiguous share a worker, and an idle worker takes from another's tail
    (`worksteal`, pytest-xdist >= 3.2; before it `load`, tests dealt one by one): the tests of one file mostly stay
    in one process, which compiles their kernels once."""
    if workers <= 1:
        return []
    try:
        import xdist
    except ImportError:
        if log is not None:
            log.write(f"gpu tests: pytest-xdist is not installed: one process, not {workers}\n")
            log.flush()
        return []
    major, minor = (int(part) for part in re.findall(r"\d+", xdist.__version__)[:2])
    return ["-n", str(workers), "--dist", "worksteal" if (major, minor) >= (3, 2) else "load"]


def outcome_counts(outcomes: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    """How many tests ended each way, and the node ids of those that failed or errored."""
    counts = {word: sum(v == word for v in outcomes.values()) for word in sorted(set(outcomes.values()))}
    return counts, [test for test, outcome in outcomes.items() if outcome in ("FAILED", "ERROR")]


def _pytest_outcomes(log: str) -> dict[str, str]:
    """node id -> PASSED | FAILED | ERROR | SKIPPED | XFAIL | XPASS, from pytest -v lines (the last word wins:
    a test that fails in teardown after passing is an ERROR): `<node id> OUTCOME [ n%]` in one process,
    `[gwK] [ n%] OUTCOME <node id>` from pytest-xdist's workers."""
    plain = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
    worker = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+::\S+)")
    outcomes = {}
    for line in log.splitlines():
        if m := plain.match(line):
            outcomes[m.group(1)] = m.group(2)
        elif m := worker.match(line):
            outcomes[m.group(2)] = m.group(1)
    return outcomes


def _ttft_ms(engine, prompt: list[int]) -> float:
    """Time from submitting one request to its first token, the engine otherwise idle."""
    from kestrel.engine.sampling_params import SamplingParams

    _sync()
    start = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while True:
        outs = [o for o in engine.step() if o.request_id == rid and o.new_token_ids]
        if outs:
            break
    _sync()
    ms = 1000 * (time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return ms


def _serve(args: list[str], port: int):
    """`kestrel serve` on this machine, in the background; returns the process once /health answers and it
    is still running (an answer from another process's server on the same port would otherwise pass)."""
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "kestrel.serve.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=open(f"/tmp/serve-{port}.log", "w"),
    )
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            time.sleep(0.5)  # a server that lost the port to another one exits at once
            if proc.poll() is None:
                return proc
            raise RuntimeError(f"port {port}: another server answered; ours exited: " + _log_tail(port))
        except RuntimeError:
            raise
        except Exception:  # noqa: BLE001 - still starting
            if proc.poll() is not None:
                raise RuntimeError(_log_tail(port)) from None
            time.sleep(1)
    raise RuntimeError("the server did not come up")


def _log_tail(port: int, chars: int = 2000) -> str:
    try:
        return Path(f"/tmp/serve-{port}.log").read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(no server log: {e})"


def _host_profile(fn, top: int = 40) -> dict:
    """fn under cProfile: its wall time and the functions with the most own (tottime) and total time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - start
    # {(file, line, func): (primitive calls, calls, tottime, cumtime, callers)}
    stats = pstats.Stats(prof).stats

    def rows(key: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top]
        return [
            {
                "fn": f"{Path(f).name}:{line}({name})",
                "calls": c[1],
                "own_ms": 1000 * c[2],
                "total_ms": 1000 * c[3],
            }
            for (f, line, name), c in ranked
        ]

    return {"wall_ms": 1000 * wall, "by_own_time": rows(2), "by_total_time": rows(3)}


def _fresh_append(gen: torch.Generator) -> list[int]:
    return torch.randint(3, S.token_ids, (S.append,), generator=gen).tolist()


def _recurrent_prefill_ab(engine, history: list[int], gen: torch.Generator, repeats: int = 3) -> dict:
    """TTFT (ms) of fresh appends on the cached history with fla's KDA prefill in each form (`_kda_prefill`:
    the chunked kernels, the recurrent one), alternating, each `repeats` times."""
    times: dict[str, list[float]] = {"chunked": [], "recurrent": []}
    for _ in range(repeats):
        for form in times:
            with _kda_prefill(form):
                times[form].append(_ttft_ms(engine, history + _fresh_append(gen)))
    return {"ms": times, "min_ms": {k: min(v) for k, v in times.items()}}


def cache_ttft() -> dict:
    """Issue 6's first target on mini: TTFT of a turn with a 32K cached history and a 500-token append vs the
    same turn with the cache off; then where the cached turn's time goes (torch.profiler over the same turn
    once more: its kernels' own time and count, the top kernels and the top CPU ops)."""
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.models.loader import build_model
    from kestrel.utils.collector import freeze_startup_objects

    os.environ["KESTREL_MOE_GROUPED_MM"] = _probe_grouped_mm()
    result: dict = {}
    net = build_model(S.model, dtype=torch.bfloat16, device=S.device, seed=0, init_on_device=True)
    g = torch.Generator().manual_seed(0)
    history = torch.randint(3, S.token_ids, (S.history,), generator=g).tolist()
    turn = history + torch.randint(3, S.token_ids, (S.append,), generator=g).tolist()
    warm = torch.Generator().manual_seed(1)
    for cache in (False, True):
        engine = Engine(
            EngineConfig(
                model=S.model,
                max_running_requests=4,
                max_model_len=S.ttft_max_len,
                enable_prefix_cache=cache,
                chunked_prefill_size=8192,
                disable_cuda_graph=True,  # the first token comes from the prefill step: no decode graphs needed
            ),
            model=net,
        )
        # The same warm-up for both engines, sharing no prefix with the history: an unrelated history, then a
        # turn on it (with the cache on, a hit: it compiles and autotunes the short prefill over a long cached
        # context too, so the timed turn measures the cache, not a first compilation).
        other = torch.randint(3, S.token_ids, (S.history,), generator=warm).tolist()
        _ttft_ms(engine, other + [5])
        _ttft_ms(engine, other + _fresh_append(warm))
        if cache:
            _ttft_ms(
                engine, history + [5]
            )  # the previous turn: leaves a checkpoint at the end of the history
        freeze_startup_objects()  # as `kestrel serve` does after its warm-up
        key = f"ttft_ms_cache_{'on' if cache else 'off'}"
        result[key] = _ttft_ms(engine, turn)
        # Two more of the same kind (cache off: the same turn; on: fresh appends on the cached history), so that
        # one run slowed by the host's other work does not decide the ratio: the median of three is reported too.
        result[f"{key}_runs"] = [result[key]] + [
            _ttft_ms(engine, turn if not cache else history + _fresh_append(warm)) for _ in range(2)
        ]
        if cache:  # the same kind of turn (a fresh append on the history) with the KDA prefill form switched
            result["kda_recurrent_prefill_ab"] = _recurrent_prefill_ab(engine, history, warm)
        if (
            cache
        ):  # the same turn once more, profiled: its history is still cached, the append is a hit now too
            ms, prof, events, own = _profiled(functools.partial(_ttft_ms, engine, turn[:-1] + [7]))
            kinds = {e.device_type for e in events}
            cpu = [e for e in prof.key_averages() if e.device_type not in kinds or S.device != "cuda"]
            result["profiled_hit"] = {
                "ttft_ms": ms,
                "kernels_ms": sum(own(e) for e in events) / 1000,
                "kernel_launches": sum(e.count for e in events),
                "top_kernels": [
                    {"name": e.key[:90], "ms": own(e) / 1000, "calls": e.count}
                    for e in sorted(events, key=own, reverse=True)[:15]
                ],
                "top_cpu_ops": [
                    {"name": e.key[:90], "ms": e.self_cpu_time_total / 1000, "calls": e.count}
                    for e in sorted(cpu, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
                ],
                "most_launched": [
                    {"name": e.key[:90], "calls": e.count, "ms": own(e) / 1000}
                    for e in sorted(events, key=lambda e: e.count, reverse=True)[:25]
                ],
            }
            # and where the host's time goes in a hit turn with a fresh 500-token append (Python's profiler:
            # the launches are asynchronous, so this is the host's own time, syncs included)
            fresh = history + _fresh_append(warm)
            result["host_profile_hit"] = _host_profile(functools.partial(_ttft_ms, engine, fresh))
        engine = None  # noqa: F841
        torch.cuda.empty_cache()
    result["ttft_ratio"] = result["ttft_ms_cache_on"] / result["ttft_ms_cache_off"]
    medians = [statistics.median(result[f"ttft_ms_cache_{c}_runs"]) for c in ("on", "off")]
    result["ttft_ratio_of_medians"] = medians[0] / medians[1]
    print("ttft", json.dumps(result)[:4000], flush=True)
    del net, engine
    gc.collect()  # the weights' memory back before cache_targets starts its servers
    torch.cuda.empty_cache()
    return result


def cache_targets(
    configs: tuple[str, ...] = ("enough_memory", "gpu_25pct_no_host", "gpu_25pct_host"),
) -> dict:
    """Issue 6's targets on mini: (1) `cache_ttft` (with every configuration); (2) reuse of reusable tokens in
    the agent workload with enough memory; (3) agent throughput with the GPU pool at 25% of the working set,
    host tier on vs off."""
    from kestrel.bench.agent import AgentBenchConfig, Spread, run_sweep

    result = cache_ttft() if len(configs) == 3 else {}

    a = S.agent
    append, reply = Spread("uniform", *a["append_tokens"]), Spread("uniform", *a["reply_tokens"])
    workload = dict(
        concurrency=(a["concurrency"],),
        turns=a["turns"],
        history_tokens=a["history_tokens"],
        append_tokens=append,
        reply_tokens=reply,
        think_time_s=Spread("uniform", *a["think_time_s"]),
        chars_per_token=1.0,
        token_chunks=True,  # random weights: most ids have no text, so time the tokens (logprobs chunks)
    )
    # The working set: every session's final context (history + 4 turns of mean append and reply) in KV bytes
    from kestrel.cache.kv_pool import KVPool
    from kestrel.presets import preset_config

    per_token = KVPool.bytes_per_token(preset_config(S.model), torch.bfloat16)
    session = a["history_tokens"] + a["turns"] * (append.mean + reply.mean)
    working_set = a["concurrency"] * session * per_token
    # three significant digits: 0.203 on mini, and not 0.000 for the smoke run's pool
    pool_gb = f"{0.25 * working_set / 2**30:.3g}"
    # The KDA checkpoints are GPU cache memory too: a session keeps about one a turn plus its history's, so the
    # limited configurations keep a quarter of those, and never fewer than one per session (each running
    # request tracks its state at page boundaries in one).
    checkpoints = max(a["concurrency"], round(0.25 * a["concurrency"] * (a["turns"] + 1)))
    result["working_set_gib"], result["gpu_pool_gib_at_25pct"] = working_set / 2**30, float(pool_gb)
    result["checkpoints_at_25pct"] = checkpoints
    base = ["--model", S.model, *S.serve_args]
    port = S.port or _free_port()
    limited = ["--kv-cache-gb", pool_gb, "--num-checkpoints", str(checkpoints)]
    every = {
        "enough_memory": [],
        "gpu_25pct_no_host": limited,
        "gpu_25pct_host": [*limited, "--hicache-host-gb", S.host_gb],
    }
    for name, extra in ((name, every[name]) for name in configs):
        try:  # one configuration failing keeps the figures of the others
            proc = _serve(base + extra, port)
            try:
                sweep = run_sweep(
                    AgentBenchConfig(base_url=f"http://127.0.0.1:{port}/v1", **workload), progress=False
                )
            finally:
                proc.terminate()
                proc.wait(60)
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": repr(e)[-1500:]}
            print(name, "failed:", repr(e)[-400:], flush=True)
            continue
        level = sweep["levels"][0]["summary"]
        result[name] = {
            "output_tokens_per_s": level["output_tokens_per_s"],
            "num_ok": level["num_ok"],
            "num_failed": level["num_failed"],
            "sessions_ended": level["sessions_ended"],
            "server_cache": level["server_cache"],
            "ttft_s": level["ttft_s"],
        }
        if level["num_failed"] or level["server_cache"] is None:  # the server's own account, to read later
            result[name]["server_log_tail"] = _log_tail(port, 3000)
        print(name, json.dumps(result[name])[:400], flush=True)
    if all(
        name in result and "error" not in result[name] for name in ("gpu_25pct_host", "gpu_25pct_no_host")
    ):
        result["host_tier_speedup"] = (
            result["gpu_25pct_host"]["output_tokens_per_s"]
            / result["gpu_25pct_no_host"]["output_tokens_per_s"]
        )
    return result


def agent_sweep() -> dict:
    """Issue 6's agent benchmark on the H200: `kestrel serve` on mini (random weights, prefix cache on, enough
    memory), driven by `kestrel bench agent`'s sweep over concurrency. Writes $OUT/agent.json (the PNG is
    drawn from it afterwards with kestrel.bench.agent.report.plot_sweep: the device image has no matplotlib)."""
    from kestrel.bench.agent import AgentBenchConfig, Spread, run_sweep
    from kestrel.bench.agent.report import write_json

    w = S.sweep
    cfg = AgentBenchConfig(
        concurrency=tuple(w["concurrency"]),
        turns=w["turns"],
        history_tokens=w["history_tokens"],
        append_tokens=Spread("uniform", *w["append_tokens"]),
        reply_tokens=Spread("uniform", *w["reply_tokens"]),
        think_time_s=Spread("uniform", *w["think_time_s"]),
        chars_per_token=1.0,
        token_chunks=True,  # random weights: most ids have no text, so time the tokens (logprobs chunks)
    )
    port = S.port or _free_port()
    cfg = dataclasses.replace(cfg, base_url=f"http://127.0.0.1:{port}/v1")
    proc = _serve(["--model", S.model, *S.sweep_serve_args], port)
    try:
        result = run_sweep(cfg, progress=False, on_level=lambda r: write_json(r, OUT / "agent.json"))
    finally:
        proc.terminate()
        proc.wait(60)
    write_json(result, OUT / "agent.json")
    levels = [
        {"concurrency": level["concurrency"], **{k: level["summary"].get(k) for k in _SWEEP_KEYS}}
        for level in result["levels"]
    ]
    for level in levels:
        print("agent", json.dumps(level)[:400], flush=True)
    return {"levels": levels, "json": "agent.json"}


_SWEEP_KEYS = (
    "num_ok",
    "num_failed",
    "output_tokens_per_s",
    "output_tokens_per_s_per_gpu",
    "decode_tokens_per_s_per_user",
    "ttft_s",
    "server_cache",
)


def bench_kernels() -> dict:
    from kestrel.bench.kernels import KERNEL_CASES, kernels_bench

    return kernels_bench(S.device, S.kernel_cases or KERNEL_CASES)


def bench_decode() -> dict:
    """Issue 4's decode targets: MBU at batch 1 and 256 (4K context), and the DSA step at 128K against 4K
    (batch 1 and 8), with dense MLA beside it; then the 4K points on an engine of `kestrel serve`'s default
    limit (decode's graphs that wide: session 47 found batch 256 at half the tight limit's speed there), and
    those once more with short graphs beside (`--cuda-graph-short-len`)."""
    from kestrel.bench.decode import decode_bench

    os.environ["KESTREL_MOE_GROUPED_MM"] = _probe_grouped_mm()
    sizes = dict(contexts=S.decode_bench_contexts, steps=S.decode_steps, device=S.device)
    result = decode_bench(S.model, batches=S.decode_bench_batches, **sizes)
    # FP8 indexer keys (E4M3 + a scale per token) halve the bytes that dominate a 128K DSA step
    fp8 = decode_bench(
        S.model, batches=S.decode_bench_fp8_batches, dense_contrast=False, index_key_dtype="fp8", **sizes
    )
    result["runs"] += fp8["runs"]
    for short in (0, S.decode_short_graph_len):
        wide = decode_bench(  # dense MLA too: models without DSA decode through it
            S.model,
            batches=S.decode_bench_batches,
            max_model_len=S.decode_serve_limit,
            short_graph_len=short,
            **dict(sizes, contexts=S.decode_bench_contexts[:1]),
        )
        result["runs"] += wide["runs"]
    return result


SECTIONS = {
    "ceilings": ceilings,
    "parity": parity,
    "parity_floor": parity_floor,
    "foundation": foundation,
    "kda_layers": kda_layers,
    "gpu_tests": gpu_tests,
    "engine_decode": engine_decode,
    "profile_decode": profile_decode,
    "prefill_bench": prefill_bench,
    "engine_bench": engine_bench,
    "bench_kernels": bench_kernels,
    "bench_decode": bench_decode,
    "cache_targets": cache_targets,
    "cache_ttft": cache_ttft,
    "cache_reuse": functools.partial(cache_targets, configs=("enough_memory",)),
    "cache_host": functools.partial(cache_targets, configs=("gpu_25pct_no_host", "gpu_25pct_host")),
    "agent_sweep": agent_sweep,
}


def main() -> None:
    global S, OUT
    from kestrel.presets import (
        INIT_SCHEMES,
    )  # (imports no Triton: --smoke sets TRITON_INTERPRET after parsing)
    from kestrel.serve.arg_types import positive_int  # (nor does this)

    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--sections", default="ceilings,foundation,kda_layers,gpu_tests", help="comma-separated, or all"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--parity-models",
        default=None,
        help=f"foundation: presets or checkpoint folders for the fast-vs-reference logits parity "
        f"(default {H200.parity_models}; --smoke: {SMOKE.parity_models})",
    )
    parser.add_argument(
        "--agent-concurrency",
        default=None,
        help=f"agent_sweep: concurrency levels (default {','.join(map(str, H200.sweep['concurrency']))})",
    )
    parser.add_argument(
        "--parity-init",
        default="upstream",
        choices=INIT_SCHEMES,
        help="parity: the presets' random-weight scheme (kestrel.models.loader.init_random_weights)",
    )
    parser.add_argument(
        "--kernels",
        default=None,
        help="bench_kernels: only these of kestrel.bench.kernels.KERNEL_CASES (comma-separated; default all)",
    )
    parser.add_argument(
        "--gpu-tests-parts",
        default=",".join(GPU_TEST_PARTS),
        help="gpu_tests: which parts, in order: switches, fuse, rest, or rest:K/N (the K-th of N runs of rest's "
        "files) for calls too short for the whole section, or a test file or node id under tests/",
    )
    parser.add_argument(
        "--gpu-tests-workers",
        type=positive_int,
        default=1,
        help="gpu_tests: pytest-xdist processes for each part, sharing the GPU (default 1: one process; the "
        "compiles of Triton kernels, most of the section's time, then run side by side)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="every section's code on the CPU at tiny sizes (no figures)"
    )
    args = parser.parse_args()
    if args.smoke:
        S = SMOKE
        # the reference KDA and torch attention in the engine; bench_kernels runs the kernels in Triton's
        # interpreter (read when triton is first imported: nothing has imported it yet)
        os.environ.update(KESTREL_KDA_BACKEND="naive", KESTREL_ATTN_BACKEND="torch")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import kestrel.bench.roofline as roofline  # (imports no Triton)

        roofline.CPU_TIMED_CALLS = 1  # the code runs; its timings mean nothing here
    if args.kernels:
        from kestrel.bench.kernels import KERNEL_CASES

        chosen = args.kernels.split(",")
        unknown = sorted(set(chosen) - set(KERNEL_CASES))
        if unknown:
            parser.error(f"--kernels: unknown {unknown}; choose from {sorted(KERNEL_CASES)}")
        S = dataclasses.replace(S, kernel_cases={k: (S.kernel_cases or KERNEL_CASES)[k] for k in chosen})
    try:
        gpu_test_targets(args.gpu_tests_parts.split(","))
    except ValueError as e:
        parser.error(f"--gpu-tests-parts: {e}")
    GPU_TEST_PARTS[:] = args.gpu_tests_parts.split(",")
    GPU_TEST_WORKERS[0] = args.gpu_tests_workers
    PARITY_MODELS[:] = (args.parity_models or S.parity_models).split(",")
    PARITY_INIT[0] = args.parity_init
    if args.agent_concurrency:
        S = dataclasses.replace(
            S, sweep={**S.sweep, "concurrency": tuple(int(c) for c in args.agent_concurrency.split(","))}
        )
    # foundation runs parity, cache_targets runs cache_ttft and the servers of cache_reuse and cache_host
    every = [name for name in SECTIONS if name not in ("parity", "cache_ttft", "cache_reuse", "cache_host")]
    sections = every if args.sections == "all" else args.sections.split(",")
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "gpu_suite.json"
    record = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if S.device == "cuda" else f"none (--smoke on {S.device})",
        "torch": torch.__version__,
        "sections": {},
    }
    try:
        import fla

        record["fla_core"] = getattr(fla, "__version__", "?")
    except ImportError:
        record["fla_core"] = None
    # `kestrel env --json` at the start: versions, the GPU, the fast paths, every variable (sections set some)
    record["env_at_start"] = report_or_error(S.device)
    for name in sections:
        gc.collect()  # the previous section's engines and graphs: their memory back before the next plans its pools
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        start = time.perf_counter()
        try:
            record["sections"][name] = SECTIONS[name]()
        except Exception as e:  # keep the other sections' figures
            import traceback

            traceback.print_exc()
            record["sections"][name] = {"error": repr(e)}
        record["sections"][name]["wall_s"] = time.perf_counter() - start
        out.write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "sections"}))


if __name__ == "__main__":
    main()
