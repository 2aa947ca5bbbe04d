"""What a level measured and how it is reported: percentiles, per-request records, level summaries, and
the sweep's JSON, PNG and table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kestrel.bench.agent.client import Reply
from kestrel.bench.agent.workload import Turn

# -- statistics ----------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between closest ranks; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values) -> dict:
    """n, mean, p50, p90, p99, max; p90 and p99 are the slow tail."""
    xs = [v for v in values if v is not None]
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs) if xs else None,
    }


def speed_stats(values) -> dict:
    """n, mean, p50, p90 of a speed; p90 is the slow tail (90% of values are at least this)."""
    xs = [v for v in values if v is not None]
    return {
        "n": len(xs),
        "mean": sum(xs) / len(xs) if xs else None,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 10),
    }


def summarize_level(records: list[dict], duration_s: float, num_gpus: int, itls=()) -> dict:
    """A level's figures from its request records (see `request_record`); `itls`: every inter-chunk gap."""
    ok = [r for r in records if r["ok"]]
    output = sum(r["completion_tokens"] or 0 for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = [r["cached_tokens"] for r in ok]
    rate = lambda x: x / duration_s if duration_s > 0 else None
    out_rate = rate(output)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(cached) if cached and None not in cached else None,
        "reusable_prompt_tokens": sum(r["reusable_tokens"] for r in ok),
        "requests_per_s": rate(len(ok)),
        "output_tokens_per_s": out_rate,
        "output_tokens_per_s_per_gpu": None if out_rate is None else out_rate / num_gpus,
        "total_tokens_per_s": rate(prompt + output),
        "decode_tokens_per_s_per_user": speed_stats(r["decode_tokens_per_s"] for r in ok),
        "ttft_s": latency_stats(r["ttft_s"] for r in ok),
        "ttft_s_first_turn": latency_stats(r["ttft_s"] for r in ok if r["turn"] == 0),
        "ttft_s_later_turns": latency_stats(r["ttft_s"] for r in ok if r["turn"] > 0),
        "tpot_s": latency_stats(r["tpot_s"] for r in ok),
        "itl_s": latency_stats(itls),
        "e2e_s": latency_stats(r["e2e_s"] for r in ok),
    }


def request_record(reply: Reply, session: int, turn: Turn, index: int, start_s: float, reusable: int) -> dict:
    tokens = reply.completion_tokens or 0
    decoding = reply.decode_s is not None and reply.decode_s > 0 and tokens >= 2
    return {
        "session": session,
        "turn": index,
        "ok": reply.ok,
        "error": reply.error,
        "finish_reason": reply.finish_reason,
        "start_s": start_s,
        "think_s": turn.think_s,
        "append_tokens_target": turn.append_tokens,
        "max_tokens": turn.reply_tokens,
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "cached_tokens": reply.cached_tokens,
        "usage_exact": reply.usage_exact,
        "reusable_tokens": reusable,
        "ttft_s": reply.ttft_s,
        "e2e_s": reply.e2e_s,
        "decode_s": reply.decode_s,
        "tpot_s": reply.decode_s / (tokens - 1) if decoding else None,
        "decode_tokens_per_s": (tokens - 1) / reply.decode_s if decoding else None,
        "num_chunks": reply.num_chunks,
        "itl_p50_s": percentile(reply.itls, 50),
        "itl_max_s": max(reply.itls) if reply.itls else None,
    }


DEFINITIONS = {
    "output_tokens_per_s": "completion tokens of the level / its wall time (first request sent to last answer)",
    "decode_tokens_per_s_per_user": (
        "per request: (completion tokens - 1) / (last timed chunk - first timed chunk), chunks as in ttft_s"
    ),
    "p90 of a latency": "the slow tail: 90% of requests took at most this",
    "p90 of a speed": "the slow tail ('P90 interactivity'): 90% of requests decoded at least this fast",
    "ttft_s": "request sent to the first chunk carrying text (with --token-chunks: or a token's logprobs)",
    "itl_s": "gaps between chunks carrying text or, with --token-chunks, tokens (a chunk may carry several)",
    "reusable_tokens": "prompt + completion tokens of the session's previous turn (the shared prefix on turn 0)",
    "server_cache": "change of the server's hit and query token counters over the level",
    "client_cpu_util": "CPU time of the benchmark process / the level's wall time (1.0 = one core busy)",
}


# -- output --------------------------------------------------------------------------------------------------


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def plot_sweep(result: dict, path: Path) -> None:
    """Throughput per GPU against per-user decode speed, one labeled point per concurrency (P90 and median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for key, style, label in (("p90", "o-", "P90 interactivity"), ("p50", "s--", "median")):
        points = []
        for level in result["levels"]:
            s = level["summary"]
            x, y = s["decode_tokens_per_s_per_user"][key], s["output_tokens_per_s_per_gpu"]
            if x is not None and y is not None:
                points.append((x, y, level["concurrency"]))
        if not points:
            continue
        xs, ys, cs = zip(*points)
        ax.plot(xs, ys, style, label=label, alpha=1.0 if key == "p90" else 0.45)
        if key == "p90":
            for x, y, c in points:
                ax.annotate(f"{c}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    server, cfg = result["server"], result["config"]
    ax.set_xlabel("per-user decode speed (tokens/s)")
    ax.set_ylabel(f"output throughput per GPU (tokens/s, {cfg['num_gpus']} GPU)")
    ax.set_title(
        f"agent sweep: {server['model']}, {cfg['history_tokens']}-token history, "
        f"append {cfg['append_tokens']}, reply {cfg['reply_tokens']}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(title="labels: concurrency", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(result: dict) -> str:
    """One line per level: requests, throughput, per-user speed, TTFT, E2E and the server's cache hit rate."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = (
        f"{'conc':>5} {'reqs':>5} {'fail':>4} {'out tok/s':>10} {'tok/s/GPU':>10} "
        f"{'user tok/s p50/p90':>19} {'TTFT s p50/p90':>15} {'E2E s p50/p90':>15} {'cache hit':>9}"
    )
    lines = [head, "-" * len(head)]
    for level in result["levels"]:
        s = level["summary"]
        speed, ttft, e2e = s["decode_tokens_per_s_per_user"], s["ttft_s"], s["e2e_s"]
        hit = (s["server_cache"] or {}).get("hit_rate")
        lines.append(
            f"{level['concurrency']:>5} {s['num_requests']:>5} {s['num_failed']:>4} "
            f"{f(s['output_tokens_per_s'], '.1f'):>10} {f(s['output_tokens_per_s_per_gpu'], '.1f'):>10} "
            f"{f(speed['p50'], '.1f') + ' / ' + f(speed['p90'], '.1f'):>19} "
            f"{f(ttft['p50'], '.3f') + ' / ' + f(ttft['p90'], '.3f'):>15} "
            f"{f(e2e['p50'], '.2f') + ' / ' + f(e2e['p90'], '.2f'):>15} "
            f"{f(hit, '.1%'):>9}"
        )
    return "\n".join(lines)
