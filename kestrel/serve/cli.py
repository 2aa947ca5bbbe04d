"""`kestrel` command line. The parser only builds arguments; each command is a small function.

Errors a user can cause (bad path, bad config, corrupted checkpoint, bad argument) print one line on stderr
and exit with status 1 (argparse usage errors: 2); a traceback means a bug in Kestrel.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kestrel.utils.device import resolve_device, resolve_dtype
from kestrel.utils.errors import KestrelError

BUILTIN_MODEL = "tiny"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _probability(text: str) -> float:
    value = _non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=BUILTIN_MODEL,
        help=f"checkpoint folder, or a preset name for random weights (default: {BUILTIN_MODEL})",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of random preset weights and of sampling")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other user error (subcommand parsers inherit this class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kestrel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="complete one prompt with the reference generate()")
    _add_model_args(g)
    g.add_argument("--prompt", required=True, help="the text to complete")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=_positive_int, default=32)
    g.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=_probability, default=1.0)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("init-random", help="write a random-weight checkpoint of a preset in HF format")
    r.add_argument("--preset", required=True, help="tiny | mini")
    r.add_argument("--out", required=True, type=Path, help="output folder")
    r.add_argument(
        "--format",
        default="kimi_k3",
        choices=["kimi_k3", "kimi_linear"],
        help="kimi_k3 (all features, DSA) or kimi_linear (loadable by transformers)",
    )
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--mxfp4", action="store_true", help="store routed experts as MXFP4 (kimi_k3 format)")
    r.add_argument("--max-shard-mb", type=_positive_int, default=None, help="split weights into shards")
    r.set_defaults(func=cmd_init_random)

    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and native /generate)")
    _add_model_args(s)
    _add_engine_args(s)
    s.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"
    )
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument(
        "--api-key", default=None, help="require Authorization: Bearer KEY (not on /health, /metrics)"
    )
    s.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=4096,
        help="answer 503 (Retry-After) past this many requests waiting for a slot",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="chat with a model in the terminal (through the engine)")
    _add_model_args(c)
    _add_engine_args(c)
    c.add_argument("--system", default=None, help="a system message to start the conversation with")
    c.add_argument("--max-new-tokens", type=_positive_int, default=256)
    c.add_argument("--temperature", type=_non_negative_float, default=0.7, help="0 = greedy")
    c.add_argument("--top-p", type=_probability, default=1.0)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("train", help="train a model on the procedural task mixture (resumes from --out)")
    t.add_argument(
        "--out", required=True, type=Path, help="run folder: checkpoint/, loss.png, trainer_state.pt"
    )
    t.add_argument(
        "--model", default="demo", help="preset to start from (random init) or a checkpoint folder"
    )
    t.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: train a BPE into <out>/tokenizer)"
    )
    t.add_argument("--steps", type=_positive_int, default=1000)
    t.add_argument("--batch-rows", type=_positive_int, default=16)
    t.add_argument("--row-len", type=_positive_int, default=4096)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--dsa-dense-steps", type=int, default=200, help="dense warm-up steps before sparse DSA")
    t.add_argument(
        "--retrieval-lengths", default="2048", help="comma-separated context lengths of retrieval docs"
    )
    t.add_argument("--checkpoint-every", type=_positive_int, default=500)
    t.add_argument("--time-budget-s", type=float, default=None, help="stop and checkpoint after this long")
    t.add_argument("--data-workers", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out accuracy per task family and retrieval by context length")
    e.add_argument("--model", required=True, help="checkpoint folder")
    e.add_argument("--num", type=_positive_int, default=200, help="problems per family")
    e.add_argument("--num-retrieval", type=_positive_int, default=50)
    e.add_argument("--retrieval-lengths", default="2048,8192,32768")
    e.add_argument("--max-new-tokens", type=_positive_int, default=256)
    e.add_argument("--no-dense-contrast", action="store_true", help="skip the dense-attention retrieval runs")
    e.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    e.add_argument("--device", default="auto")
    e.set_defaults(func=cmd_eval)

    from kestrel.bench import agent  # stdlib-only at import; httpx and matplotlib load when it runs

    bench = sub.add_parser(
        "bench", help="benchmarks: agent (against a server), decode and kernels (on a GPU)"
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    a = benchmarks.add_parser("agent", help="multi-turn agentic sweep against any OpenAI-compatible server")
    agent.add_arguments(a)
    a.set_defaults(func=agent.cmd_bench_agent)
    d = benchmarks.add_parser("decode", help="engine decode step vs the HBM roofline (GPU)")
    d.add_argument("--model", default="mini", help="preset or checkpoint folder (default: mini)")
    d.add_argument("--batches", type=_int_list, default=[1, 64, 256], help="comma-separated batch sizes")
    d.add_argument("--contexts", type=_int_list, default=[4096], help="comma-separated context lengths")
    d.add_argument("--steps", type=_positive_int, default=24)
    d.add_argument("--no-dense", action="store_true", help="skip the dense-MLA contrast")
    d.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    d.set_defaults(func=_bench("decode"))
    k = benchmarks.add_parser(
        "kernels", help="each fast-path kernel vs the ceilings measured in the run (GPU)"
    )
    k.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    k.set_defaults(func=_bench("kernels"))
    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _bench(name: str):
    def run(args) -> int:
        if name == "decode":
            from kestrel.bench.decode import cmd_bench_decode

            return cmd_bench_decode(args)
        from kestrel.bench.kernels import cmd_bench_kernels

        return cmd_bench_kernels(args)

    return run


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KestrelError(f"expected comma-separated token counts, got {text!r}") from None
    if any(v < 1 for v in values):
        raise KestrelError(f"token counts must be positive, got {text!r}")
    return values


def cmd_train(args) -> int:
    import json

    from kestrel.config import TrainConfig
    from kestrel.train.trainer import Trainer

    cfg = TrainConfig(
        out_dir=str(args.out),
        model=args.model,
        tokenizer=args.tokenizer,
        seed=args.seed,
        steps=args.steps,
        batch_rows=args.batch_rows,
        row_len=args.row_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        dsa_dense_steps=args.dsa_dense_steps,
        retrieval_lengths=_lengths(args.retrieval_lengths),
        checkpoint_every=args.checkpoint_every,
        time_budget_s=args.time_budget_s,
        device=args.device,
        data_workers=args.data_workers,
    )
    try:
        trainer = Trainer(cfg)
    except ValueError as e:
        raise KestrelError(str(e)) from None
    summary = trainer.train()
    (Path(args.out) / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(
        f"[kestrel] checkpoint in {args.out}/checkpoint, loss curve in {args.out}/loss.png", file=sys.stderr
    )
    return 0


def cmd_eval(args) -> int:
    import json

    from kestrel.train.evaluate import EvalConfig, evaluate, format_table

    cfg = EvalConfig(
        model=args.model,
        num_per_family=args.num,
        num_retrieval=args.num_retrieval,
        retrieval_lengths=_lengths(args.retrieval_lengths),
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dense_contrast=not args.no_dense_contrast,
    )
    result = evaluate(cfg)
    print(format_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {value}")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the model folder)")
    p.add_argument("--max-running-requests", type=_positive_int, default=64, help="= KDA state slots")
    p.add_argument("--page-size", type=_positive_int, default=64, help="tokens per KV page")
    p.add_argument(
        "--mem-fraction", type=_probability, default=0.85, help="of the free GPU memory, for KV pages"
    )
    p.add_argument(
        "--kv-cache-gb",
        type=_non_negative_float,
        default=None,
        help="KV cache size (overrides --mem-fraction)",
    )
    p.add_argument(
        "--max-model-len", type=_positive_int, default=None, help="context limit (prompt + output)"
    )
    p.add_argument("--chunked-prefill-size", type=_positive_int, default=2048, help="tokens per step")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-prefix-cache", action="store_true", help="no radix prefix cache")
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        default=1024,
        help="save a KDA checkpoint every this many prefill tokens (a multiple of --page-size; 0 = off)",
    )
    p.add_argument(
        "--num-checkpoints", type=_positive_int, default=None, help="KDA checkpoint slots on the GPU"
    )
    p.add_argument(
        "--hicache-host-gb",
        type=_non_negative_float,
        default=0.0,
        help="host memory for prefixes evicted from the GPU (pinned with CUDA; 0 = off)",
    )
    p.add_argument("--hicache-disk-dir", default=None, help="folder for prefixes evicted from host memory")
    p.add_argument("--hicache-disk-gb", type=_non_negative_float, default=0.0, help="size cap of that folder")


def _engine_config(args):
    from kestrel.config import EngineConfig

    if args.kv_cache_gb is not None and args.kv_cache_gb * 2**30 < 1:
        raise KestrelError("--kv-cache-gb must be > 0")
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_running_requests=args.max_running_requests,
        page_size=args.page_size,
        mem_fraction=args.mem_fraction,
        kv_cache_bytes=None if args.kv_cache_gb is None else int(args.kv_cache_gb * 2**30),
        max_model_len=args.max_model_len,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_cuda_graph=args.disable_cuda_graph,
        max_queued_requests=getattr(args, "max_queued_requests", 4096),
        enable_prefix_cache=not args.disable_prefix_cache,
        checkpoint_interval=args.checkpoint_interval,
        num_checkpoints=args.num_checkpoints,
        hicache_host_bytes=int(args.hicache_host_gb * 2**30),
        hicache_disk_dir=args.hicache_disk_dir,
        hicache_disk_bytes=int(args.hicache_disk_gb * 2**30),
    )


def load_tokenizer_for(model: str):
    from kestrel.tokenizer import ByteTokenizer, load_tokenizer

    path = Path(model)
    if path.is_dir() and (path / "tokenizer.json").exists():
        return load_tokenizer(str(path))
    return ByteTokenizer()


def cmd_generate(args) -> int:
    from kestrel.models.generate import generate
    from kestrel.models.loader import build_model

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = load_tokenizer_for(args.model)
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        text = args.prompt
    prompt_ids = tokenizer.encode(text)
    if not prompt_ids:
        raise KestrelError("--prompt: the prompt encodes to no tokens")
    if len(prompt_ids) + args.max_new_tokens > model.config.max_position_embeddings:
        raise KestrelError(
            f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens exceeds the model's context "
            f"of {model.config.max_position_embeddings} tokens"
        )
    if max(prompt_ids) >= model.config.vocab_size:
        raise KestrelError("the tokenizer produced ids outside the model's vocabulary; wrong tokenizer?")
    start = time.perf_counter()
    out = generate(
        model,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_ids=tuple(model.config.eos_token_ids),
    )
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(out))
    print(
        f"[kestrel] model={args.model} layers={model.config.layer_pattern} device={device} dtype={dtype} "
        f"prompt={len(prompt_ids)} tokens, generated={len(out)} tokens in {elapsed:.2f}s "
        f"({len(out) / max(elapsed, 1e-9):.1f} tokens/s, reference path{' on CUDA' if device.type == 'cuda' else ''})",
        file=sys.stderr,
    )
    return 0


def cmd_init_random(args) -> int:
    import torch

    from kestrel.config import ModelConfig
    from kestrel.models.kimi import KimiForCausalLM
    from kestrel.models.loader import init_random_weights
    from kestrel.models.weights import save_checkpoint
    from kestrel.presets import preset_hf_config
    from kestrel.tokenizer import save_byte_tokenizer

    hf = preset_hf_config(args.preset, args.format)
    config = ModelConfig.from_dict(hf)
    if args.mxfp4:
        if args.format != "kimi_k3":
            raise KestrelError("--mxfp4 needs --format kimi_k3")
        config = config.replace(experts_mxfp4=True)
    if args.out.exists() and not args.out.is_dir():
        raise KestrelError(f"--out {args.out}: exists and is not a folder")
    model = init_random_weights(KimiForCausalLM(config, getattr(torch, args.dtype)), args.seed)
    max_bytes = args.max_shard_mb * 2**20 if args.max_shard_mb else None
    save_checkpoint(model, args.out, max_shard_bytes=max_bytes)
    save_byte_tokenizer(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"[kestrel] wrote {args.preset} ({args.format}, {n / 1e6:.1f}M parameters, "
        f"layers {config.layer_pattern}) to {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args) -> int:
    import logging

    import uvicorn

    from kestrel.engine.async_engine import AsyncEngine
    from kestrel.engine.engine import Engine
    from kestrel.serve.api import build_app

    engine = Engine(_engine_config(args))
    # Configured after the engine is built, whose memory plan is printed below rather than logged twice.
    logging.basicConfig(level=args.log_level.upper(), format="[kestrel] %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or args.model
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, name, api_key=args.api_key)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"[kestrel] {engine.plan.describe()}", file=sys.stderr)
    print(
        f"[kestrel] serving {name!r} (layers {engine.model.config.layer_pattern}, device {engine.device}) "
        f"at http://{host}:{args.port}/v1{' (API key required)' if args.api_key else ''}",
        file=sys.stderr,
    )
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
    finally:
        async_engine.shutdown()
    return 0


def cmd_chat(args) -> int:
    """A terminal chat through the engine: one turn at a time, streamed. /reset clears the history; an empty
    line or EOF ends the chat."""
    from kestrel.engine.engine import Engine
    from kestrel.engine.sampling_params import SamplingParams
    from kestrel.tokenizer import IncrementalDetokenizer

    engine = Engine(_engine_config(args))
    tokenizer = engine.tokenizer
    history = [{"role": "system", "content": args.system}] if args.system else []
    start = list(history)
    print(f"[kestrel] chatting with {args.model} (empty line to quit, /reset to start over)", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            history = list(start)
            continue
        history.append({"role": "user", "content": line})
        prompt = tokenizer.encode(tokenizer.apply_chat_template(history, add_generation_prompt=True))
        room = engine.plan.max_model_len - len(prompt)
        if room < 1:
            print("[kestrel] the conversation no longer fits the context; /reset", file=sys.stderr)
            history.pop()
            continue
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=min(args.max_new_tokens, room),
            seed=args.seed + len(history),
        )
        rid = engine.add_request(prompt, params)
        detok, reply = IncrementalDetokenizer(tokenizer, prompt), []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    piece = detok.add(out.new_token_ids) + (detok.flush() if out.finished else "")
                    reply.append(piece)
                    print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (KestrelError, OSError) as e:  # OSError: an unreadable or unwritable path the user gave
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
