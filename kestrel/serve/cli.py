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
    return parser


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
