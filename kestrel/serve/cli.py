"""`kestrel` command line. The parser only builds arguments; each command is a small function.

The commands live in `kestrel.serve.commands` (generate, init-random, serve, chat),
`kestrel.serve.train_commands` (train, eval, with their arguments) and `kestrel.bench` (bench); torch, the
engine and the trainer load only when a command runs.

Errors a user can cause (bad path, bad config, corrupted checkpoint, bad argument) print one line on stderr
and exit with status 1 (argparse usage errors: 2); a traceback means a bug in Kestrel.
"""

from __future__ import annotations

import argparse
import os
import sys

from kestrel.config import EngineConfig
from kestrel.env import check_env
from kestrel.presets import INIT_SCHEMES
from kestrel.serve import arg_types
from kestrel.serve.commands import cmd_chat, cmd_generate, cmd_init_random, cmd_serve, engine_config
from kestrel.serve.reasoning_parsers import REASONING_PARSERS
from kestrel.serve.tool_parsers import TOOL_CALL_PARSERS
from kestrel.serve.train_commands import add_train_parsers
from kestrel.utils.errors import KestrelError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder, `kestrel-demo` (the trained demo model, when installed), or a preset name "
        "for random weights: tiny, mini, demo, demo-attn4 (default: kestrel-demo if installed, else tiny)",
    )
    p.set_defaults(builtin_model_default=True)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--seed", type=arg_types.seed, default=0, help="seed of random preset weights and of sampling"
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the model folder)")
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, used instead of the tokenizer's own (vLLM's)",
    )
    p.add_argument(
        "--max-running-requests", type=arg_types.positive_int, default=64, help="= KDA state slots"
    )
    p.add_argument("--page-size", type=arg_types.positive_int, default=64, help="tokens per KV page")
    p.add_argument(
        "--index-key-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="DSA indexer keys in the KV pool: the model dtype, or FP8 E4M3 with one scale per token",
    )
    p.add_argument(
        "--mem-fraction",
        type=arg_types.positive_share,
        default=0.85,
        help="of the free GPU memory, for KV pages",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=arg_types.non_negative_float,
        default=None,
        help="KV pages' size in GiB (overrides --mem-fraction); the prefix cache's KDA checkpoints come on top "
        "(--num-checkpoints)",
    )
    p.add_argument(
        "--max-model-len",
        type=arg_types.positive_int,
        default=None,
        help="context limit (prompt + output), at most the model's (default: the model's)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=arg_types.positive_int,
        default=None,
        help="tokens per step (prefill chunks + decode) (default: 8192 on a GPU, 512 on the CPU, where a prefill "
        "step costs more than in proportion to its tokens and stalls every stream; at least twice "
        "--max-running-requests)",
    )
    p.add_argument(
        "--disable-cuda-graph", action="store_true", help="run decode eagerly, without CUDA graphs"
    )
    p.add_argument(
        "--cuda-graph-short-len",
        type=arg_types.non_negative_int,
        default=EngineConfig.cuda_graph_short_len,
        help="decode graphs this many tokens wide beside those of the whole context limit (where it is at least "
        "twice this), taken by steps whose contexts all fit, so that a short context runs no kernel sized for the "
        "limit; twice the graphs to capture at start. 0: graphs of the whole limit only (default %(default)s)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each decode step back before launching the next (default: launch it first)",
    )
    p.add_argument("--disable-prefix-cache", action="store_true", help="no radix prefix cache")
    p.add_argument(
        "--checkpoint-interval",
        type=arg_types.non_negative_int,
        default=8192,
        help="save a KDA checkpoint every this many prefill tokens (a multiple of --page-size; 0 = off); "
        "prefill chunks end there",
    )
    p.add_argument(
        "--num-checkpoints",
        type=arg_types.positive_int,
        default=None,
        help="KDA checkpoint slots (default: 4 per running request, at least 16; on the GPU up to 1/8 of the cache)",
    )
    p.add_argument(
        "--hicache-host-gb",
        type=arg_types.non_negative_float,
        default=0.0,
        help="host memory for prefixes evicted from the GPU (pinned with CUDA; 0 = off)",
    )
    p.add_argument("--hicache-disk-dir", default=None, help="folder for prefixes evicted from host memory")
    p.add_argument(
        "--hicache-disk-gb", type=arg_types.non_negative_float, default=0.0, help="size cap of that folder"
    )


_engine_config = engine_config  # the name tests/serve/test_hicache_server.py imports from here


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help shows each option's default where it has one and its help does not already say it (a flag's
    False and an unset None are no defaults worth a line)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or any(default is nothing for nothing in (None, False, argparse.SUPPRESS))
            or not action.option_strings
            or isinstance(action, argparse._HelpAction)
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other user error (subcommand parsers inherit this class, and with it
    the help that shows each option's default)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kestrel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="complete one prompt with the reference generate()")
    _add_model_args(g)
    g.add_argument("--prompt", required=True, help="the text to complete")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument(
        "--max-new-tokens", type=arg_types.positive_int, default=32, help="tokens to generate at most"
    )
    g.add_argument("--temperature", type=arg_types.non_negative_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=arg_types.top_k, default=0, help="0 = off")
    g.add_argument("--top-p", type=arg_types.positive_share, default=1.0, help="nucleus sampling's mass")
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("init-random", help="write a random-weight checkpoint of a preset in HF format")
    r.add_argument(
        "--preset",
        required=True,
        help="tiny | mini (the demo presets train with their own tokenizer: `kestrel train`)",
    )
    r.add_argument(
        "--out",
        required=True,
        type=arg_types.path,
        help="output folder (one holding a checkpoint: --overwrite)",
    )
    r.add_argument("--overwrite", action="store_true", help="replace the checkpoint already in --out")
    r.add_argument(
        "--format",
        default="kimi_k3",
        choices=["kimi_k3", "kimi_linear"],
        help="kimi_k3 (all features, DSA) or kimi_linear (loadable by transformers)",
    )
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the weights' dtype")
    r.add_argument("--seed", type=arg_types.seed, default=0, help="seed of the random weights")
    r.add_argument(
        "--init",
        default="upstream",
        choices=INIT_SCHEMES,
        help="upstream: normal(0.02) as transformers and fla; conditioned: the same draws, embedding x10 and "
        "residual outputs / sqrt(2 x layers) (a bf16 floor of ~1.5%% instead of ~12%% on mini)",
    )
    r.add_argument("--mxfp4", action="store_true", help="store routed experts as MXFP4 (kimi_k3 format)")
    r.add_argument(
        "--max-shard-mb", type=arg_types.positive_int, default=None, help="split weights into shards"
    )
    r.set_defaults(func=cmd_init_random)

    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and native /generate)")
    _add_model_args(s)
    _add_engine_args(s)
    s.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)"
    )
    s.add_argument("--port", type=arg_types.port, default=8000, help="TCP port to listen on")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names clients may send (vLLM's: one or more, such as the names a client such as Claude "
        "Code asks for); the first is the one replies report (default: --model)",
    )
    s.add_argument(
        "--api-key",
        type=arg_types.api_key,
        default=None,
        help="require Authorization: Bearer KEY (not on /health, /ping, /metrics)",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        type=arg_types.origin,
        default=None,
        metavar="ORIGIN",
        help="web pages from these origins may call the API from a browser (CORS; * for any; default: none)",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help='the model\'s own tool-call format, read where tool_choice is "auto" (the default where a request '
        "gives tools): kimi_k2, hermes (Hermes, Qwen 2.5/3; qwen25 the same), deepseek_v3 (also R1), deepseek_v31; "
        'default: none, and "auto" is a 400',
    )
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice \"auto\", taken for its commands' sake: --tool-call-parser alone "
        "enables it here, and this needs it",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="the model's thinking format: its <think>...</think> returned as reasoning_content (and reasoning) "
        "beside the answer: deepseek_r1 (the reply starts thinking), qwen3 or kimi_k2 (where it opens with "
        "<think>); default: none, the reply is all answer",
    )
    s.add_argument(
        "--max-request-mb",
        type=arg_types.positive_float,
        default=64,
        help="answer 413 to a request body larger than this (MiB), before reading it whole",
    )
    s.add_argument(
        "--max-queued-requests",
        type=arg_types.positive_int,
        default=4096,
        help="answer 503 (Retry-After) past this many requests waiting for a slot",
    )
    s.add_argument(
        "--warmup",
        default="auto",
        choices=["auto", "on", "off"],
        help="run throwaway requests before serving, so the first client does not wait for the kernels' "
        "compilation (auto: on CUDA only; the CPU paths compile nothing)",
    )
    s.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="the server's logging (default: KESTREL_LOG_LEVEL, else info)",
    )
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("chat", help="chat with a model in the terminal (through the engine)")
    _add_model_args(c)
    _add_engine_args(c)
    c.add_argument("--system", default=None, help="a system message to start the conversation with")
    c.add_argument(
        "--max-new-tokens", type=arg_types.positive_int, default=256, help="tokens a reply has at most"
    )
    c.add_argument("--temperature", type=arg_types.non_negative_float, default=0.7, help="0 = greedy")
    c.add_argument("--top-p", type=arg_types.positive_share, default=1.0, help="nucleus sampling's mass")
    c.set_defaults(func=cmd_chat)

    add_train_parsers(sub)

    from kestrel.bench import agent  # stdlib-only at import; httpx and matplotlib load when it runs

    v = sub.add_parser(
        "env",
        help="this machine's versions, GPUs and fast paths, and every KESTREL_* variable (for bug reports)",
    )
    v.add_argument("name", nargs="?", default=None, help="describe one variable (KESTREL_PDL, PDL or pdl)")
    v.add_argument(
        "--device", default=None, help="the device whose fast paths to list (default: cuda if any)"
    )
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.set_defaults(func=_env)

    bench = sub.add_parser(
        "bench", help="benchmarks: agent (against a server), decode and kernels (on a GPU), plot-decode"
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    a = benchmarks.add_parser("agent", help="multi-turn agentic sweep against any OpenAI-compatible server")
    agent.add_arguments(a)
    a.set_defaults(func=agent.cmd_bench_agent)
    d = benchmarks.add_parser("decode", help="engine decode step vs the HBM roofline (GPU)")
    d.add_argument("--model", default="mini", help="preset or checkpoint folder (default: mini)")
    d.add_argument(
        "--batches", type=arg_types.int_list, default=[1, 64, 256], help="comma-separated batch sizes"
    )
    d.add_argument(
        "--contexts", type=arg_types.int_list, default=[4096], help="comma-separated context lengths"
    )
    d.add_argument(
        "--steps", type=arg_types.positive_int, default=24, help="decode steps timed at each point"
    )
    d.add_argument("--no-dense", action="store_true", help="skip the dense-MLA contrast")
    d.add_argument(
        "--max-model-len",
        type=arg_types.positive_int,
        default=None,
        help="the engine's context limit at every point (default: each context plus the steps, the least "
        "that holds it); `kestrel serve` defaults to the model's own, and decode's graphs are that wide",
    )
    d.add_argument(
        "--cuda-graph-short-len",
        type=arg_types.non_negative_int,
        default=EngineConfig.cuda_graph_short_len,
        help="as `kestrel serve`'s: the short decode graphs' width in tokens (default %(default)s; 0: graphs of "
        "the whole limit only)",
    )
    d.add_argument(
        "--index-key-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="DSA indexer keys: model dtype or FP8",
    )
    d.add_argument(
        "--profile", action="store_true", help="break each replayed step down by kernel (torch.profiler)"
    )
    d.add_argument(
        "--sampling",
        choices=["greedy", "logprobs", "penalties", "steer", "grammar"],
        default="greedy",
        help="what the requests ask beside greedy tokens: top-5 logprobs, frequency and presence penalties, a "
        "logit_bias (64 tokens) and allowed_token_ids (256), or a grammar (structured outputs)",
    )
    d.add_argument("--out", type=arg_types.path, default=None, help="write the results as JSON here")
    d.set_defaults(func=_bench("decode"))
    pd = benchmarks.add_parser(
        "plot-decode", help="draw a `bench decode` result: where each point's step goes (PNG, PDF, SVG)"
    )
    pd.add_argument("result", type=arg_types.path, help="the JSON `bench decode --out` wrote")
    pd.add_argument(
        "--out",
        type=arg_types.path,
        default=None,
        help="the picture; its suffix names the format: .png, .pdf, .svg... (default: the result's path, .png)",
    )
    pd.set_defaults(func=_bench("plot-decode"))
    k = benchmarks.add_parser(
        "kernels", help="each fast-path kernel vs the ceilings measured in the run (GPU)"
    )
    k.add_argument("--out", type=arg_types.path, default=None, help="write the results as JSON here")
    k.set_defaults(func=_bench("kernels"))
    return parser


def _env(args) -> int:
    from kestrel.serve.env_report import cmd_env

    return cmd_env(args)


def _bench(name: str):
    def run(args) -> int:
        if name == "decode":
            from kestrel.bench.decode import cmd_bench_decode

            return cmd_bench_decode(args)
        if name == "plot-decode":
            from kestrel.bench.decode_plot import cmd_plot_decode

            return cmd_plot_decode(args)
        from kestrel.bench.kernels import cmd_bench_kernels

        return cmd_bench_kernels(args)

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command != "env":  # which lists a bad variable beside the rest
            check_env()
        if getattr(args, "builtin_model_default", False) and args.model is None:  # serve, generate, chat
            from kestrel.presets import builtin_model

            args.model = builtin_model()
        return args.func(args)
    except BrokenPipeError:  # `kestrel env | head`: the reader has gone, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush would raise again)
        return 0
    except (KestrelError, OSError) as e:  # OSError: an unreadable or unwritable path the user gave
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
