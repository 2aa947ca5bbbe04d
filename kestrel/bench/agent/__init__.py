"""`kestrel bench agent`: an agentic multi-turn workload against any OpenAI-compatible server, over a
concurrency sweep.

The workload (deterministic from `--seed`, so the same sessions can be replayed against other engines):
each session opens with a long system prompt and history (`--history-tokens`: procedurally generated tool
logs, code, grep hits, JSON lines and test reports; the first `--shared-prefix-tokens` are the same in every
session). Each turn appends a tool result (`--append-tokens`) as a user message, asks for a reply of
`--reply-tokens` (as `max_tokens`, with `ignore_eos` where the server accepts it), appends the server's reply
to the history, and waits a think time (`--think-time-s`) before the next turn. The history grows with the
model's own replies, so a server's prefix cache can reuse all of it. Each concurrency level runs as many
sessions as its concurrency, for `--turns` turns or `--duration-s` seconds; levels use fresh sessions, so one
level's cache does not serve the next.

Token lengths come from `--tokenizer` (exact), `--chars-per-token`, or by default a ratio measured on the
server at start-up from the `usage` of two short requests. Requests are streamed chat completions with
`stream_options.include_usage` (exact token counts); features the server refuses are dropped at start-up.

Per level: output tokens/s (and per GPU), per-user decode tokens/s, TTFT, TPOT, inter-chunk times, E2E
latency, and the server's prefix-cache hit rate over the level (the change in its hit and query token
counters, read from Kestrel's `/get_server_info` or from Prometheus `/metrics`; absent on servers without
them), per tier where the server splits them. Percentiles interpolate between ranks. Latency `p90` is the
slow tail (90% of requests were faster); per-user speed `p90` is the same tail, "P90 interactivity": 90% of
requests decoded at least this fast.

Output in `--out`: `agent.json` (config, command line, date, server info, per level a summary and every
request's record; rewritten after each level) and `agent.png` (throughput per GPU against per-user speed,
one labeled point per concurrency).

Modules: `config` (the settings), `workload` (generated text and session scripts), `client` (the streaming
client and start-up probing), `server_cache` (the server's cache counters), `sweep` (running the levels),
`report` (statistics, JSON, PNG, table), `cli` (the command). Everything public is importable from here;
importing it loads only the standard library (httpx, tqdm and matplotlib load when a sweep runs).
"""

from __future__ import annotations

from kestrel.bench.agent.cli import add_arguments, cmd_bench_agent, config_from_args
from kestrel.bench.agent.client import Client, Reply, ServerProfile, connect
from kestrel.bench.agent.config import (
    CALIBRATION_CHARS,
    CLIENT_CPU_WARNING,
    CONTEXT_SLACK_TOKENS,
    DEFAULT_CHARS_PER_TOKEN,
    DEFAULT_TURNS,
    AgentBenchConfig,
    Spread,
)
from kestrel.bench.agent.report import (
    DEFINITIONS,
    format_table,
    latency_stats,
    percentile,
    plot_sweep,
    request_record,
    speed_stats,
    summarize_level,
    write_json,
)
from kestrel.bench.agent.server_cache import cache_deltas, read_cache_counters
from kestrel.bench.agent.sweep import run_sweep
from kestrel.bench.agent.workload import SessionPlan, TextSizer, TextSource, Turn

__all__ = [
    "CALIBRATION_CHARS",
    "CLIENT_CPU_WARNING",
    "CONTEXT_SLACK_TOKENS",
    "DEFAULT_CHARS_PER_TOKEN",
    "DEFAULT_TURNS",
    "DEFINITIONS",
    "AgentBenchConfig",
    "Client",
    "Reply",
    "ServerProfile",
    "SessionPlan",
    "Spread",
    "TextSizer",
    "TextSource",
    "Turn",
    "add_arguments",
    "cache_deltas",
    "cmd_bench_agent",
    "config_from_args",
    "connect",
    "format_table",
    "latency_stats",
    "percentile",
    "plot_sweep",
    "read_cache_counters",
    "request_record",
    "run_sweep",
    "speed_stats",
    "summarize_level",
    "write_json",
]
