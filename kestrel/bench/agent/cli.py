"""The `kestrel bench agent` command: its options, the config they make, and the run that writes
`agent.json`, `agent.png` and the table."""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

from kestrel.bench.agent.config import DEFAULT_TURNS, AgentBenchConfig, Spread
from kestrel.bench.agent.report import format_table, plot_sweep, write_json
from kestrel.bench.agent.sweep import run_sweep
from kestrel.serve import arg_types
from kestrel.utils.errors import KestrelError


def _arg(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _number(kind, low: float, inclusive: bool):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        if not (value >= low if inclusive else value > low) or not math.isfinite(value):
            raise ValueError(f"expected a number {'>=' if inclusive else '>'} {low}, got {text!r}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `kestrel bench agent` (defaults from AgentBenchConfig, shown by --help)."""
    d = AgentBenchConfig()
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--concurrency",
        type=_arg(_int_list),
        default=(1, 4, 16, 64, 256),
        metavar="N,N,...",
        help="levels; each runs this many sessions (default 1,4,16,64,256)",
    )
    p.add_argument(
        "--turns",
        type=_arg(_number(int, 1, True)),
        default=None,
        help=f"turns per session (default {DEFAULT_TURNS}; unbounded with --duration-s)",
    )
    p.add_argument(
        "--duration-s",
        type=_arg(_number(float, 0, False)),
        default=None,
        help="stop starting turns this long after a level starts",
    )
    p.add_argument(
        "--history-tokens",
        type=_arg(_number(int, 1, True)),
        default=8192,
        help="system prompt + history each session opens with (default %(default)s)",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=_arg(_number(int, 0, True)),
        default=0,
        help="the start of the system prompt, shared by all sessions (default %(default)s)",
    )
    tokens = _arg(lambda t: Spread.parse(t, integer=True))
    p.add_argument(
        "--append-tokens",
        type=tokens,
        default=d.append_tokens,
        help="tool result per turn: N or LO,HI (default %(default)s)",
    )
    p.add_argument(
        "--reply-tokens",
        type=tokens,
        default=d.reply_tokens,
        help="max_tokens per turn: N or LO,HI (default %(default)s)",
    )
    p.add_argument(
        "--think-time-s",
        type=_arg(Spread.parse),
        default=d.think_time_s,
        help="pause between turns: X, LO,HI (uniform) or exp:MEAN (default %(default)s)",
    )
    p.add_argument(
        "--num-gpus",
        type=_arg(_number(int, 1, True)),
        default=1,
        help="GPUs behind the server, for tokens/s per GPU (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated sessions (default %(default)s)")
    p.add_argument(
        "--temperature", type=_arg(_number(float, 0, True)), default=0.0, help="(default %(default)s)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder to size the text exactly")
    p.add_argument(
        "--chars-per-token",
        type=_arg(_number(float, 0, False)),
        default=None,
        help="size the text by this ratio (default: measured on the server)",
    )
    p.add_argument(
        "--request-timeout-s",
        type=_arg(_number(float, 0, False)),
        default=600.0,
        help="(default %(default)s)",
    )
    p.add_argument(
        "--token-chunks",
        action="store_true",
        help="request logprobs, so that each token comes in its own chunk and is timed even when the server "
        "holds its text back (random-weight models)",
    )
    p.add_argument(
        "--out",
        type=arg_types.path,
        default=None,
        help="result folder (default bench/results/<date>-agent, or <date>-agent-N past the day's first sweep; "
        "one already holding a sweep: --overwrite)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the sweep already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args) -> AgentBenchConfig:
    return AgentBenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        turns=args.turns,
        duration_s=args.duration_s,
        history_tokens=args.history_tokens,
        shared_prefix_tokens=args.shared_prefix_tokens,
        append_tokens=args.append_tokens,
        reply_tokens=args.reply_tokens,
        think_time_s=args.think_time_s,
        num_gpus=args.num_gpus,
        seed=args.seed,
        temperature=args.temperature,
        tokenizer=args.tokenizer,
        chars_per_token=args.chars_per_token,
        request_timeout_s=args.request_timeout_s,
        token_chunks=args.token_chunks,
    )


def _free_folder(folder: Path) -> Path:
    """`folder`, or the first of folder-2, folder-3, ... that holds no sweep: the default folder is named by the
    date, and a second run that day must not replace the first."""
    candidate, i = folder, 1
    while (candidate / "agent.json").exists():
        i += 1
        candidate = folder.with_name(f"{folder.name}-{i}")
    return candidate


def cmd_bench_agent(args) -> int:
    cfg = config_from_args(args)
    try:
        import httpx  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise KestrelError(f"kestrel bench agent needs {e.name} (pip install {e.name})") from None
    out = args.out or _free_folder(Path("bench/results") / f"{datetime.date.today().isoformat()}-agent")
    if (out / "agent.json").exists() and not args.overwrite:
        # the sweep writes its JSON after each level: an earlier run's result went at the first one, unasked
        raise KestrelError(
            f"--out {out} already holds a sweep (agent.json); give --overwrite, or another folder"
        )
    if out.exists() and not out.is_dir():  # (mkdir's bare "[Errno 17] File exists" named no option)
        raise KestrelError(f"--out {out}: exists and is not a folder (the result folder)")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)  # an unwritable folder fails here, not after the sweep
    except OSError as e:
        raise KestrelError(f"--out {out}: {e.strerror}") from None
    json_path, png_path = out / "agent.json", out / "agent.png"
    try:
        result = run_sweep(cfg, progress=not args.no_progress, on_level=lambda r: write_json(r, json_path))
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    write_json(result, json_path)
    plot_sweep(result, png_path)
    print(format_table(result))
    print(f"[kestrel] wrote {json_path} and {png_path}", file=sys.stderr)
    return 0
