"""The concurrency sweep: per level, as many sessions as its concurrency run their turns side by side
against the server, and the level is summarized with the server's cache counters before and after."""

from __future__ import annotations

import asyncio
import datetime
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from kestrel.bench.agent.client import Client, ServerProfile, connect
from kestrel.bench.agent.config import CLIENT_CPU_WARNING, CONTEXT_SLACK_TOKENS, AgentBenchConfig, Spread
from kestrel.bench.agent.report import DEFINITIONS, request_record, summarize_level
from kestrel.bench.agent.server_cache import cache_deltas, read_cache_counters
from kestrel.bench.agent.workload import SessionPlan, TextSizer, TextSource
from kestrel.version import KESTREL_VERSION


@dataclass
class _LevelLog:
    """What a level's sessions share: its clock, deadline and progress bar, and where they record."""

    t0: float
    deadline: float | None
    bar: object
    records: list[dict] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0

    def add(self, record: dict, itls: list[float]) -> None:
        self.records.append(record)
        self.itls.extend(itls)
        self.output_tokens += record["completion_tokens"] or 0
        rate = self.output_tokens / (time.perf_counter() - self.t0)
        self.bar.set_postfix_str(f"{rate:.0f} out tok/s", refresh=False)
        self.bar.update(1)

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline


async def _run_session(
    client: Client, profile: ServerProfile, plan: SessionPlan, index: int, log: _LevelLog
) -> str:
    """Run one session's turns; returns why it ended: turns | duration | context_limit | error."""
    cfg, messages = plan.cfg, plan.messages
    context = plan.sizer.count("".join(m["content"] for m in messages))  # tokens the next prompt starts from
    reusable = cfg.shared_prefix_tokens
    turn_index = 0
    while cfg.max_turns is None or turn_index < cfg.max_turns:
        if log.past_deadline():
            return "duration"
        turn = plan.next_turn()
        if turn.think_s > 0:
            await asyncio.sleep(turn.think_s)
            if log.past_deadline():
                return "duration"
        need = context + turn.append_tokens + turn.reply_tokens + CONTEXT_SLACK_TOKENS
        if profile.max_model_len is not None and need > profile.max_model_len:
            return "context_limit"
        messages.append({"role": "user", "content": turn.append})
        start = time.perf_counter() - log.t0
        reply = await client.chat(messages, turn.reply_tokens)
        log.add(request_record(reply, index, turn, turn_index, start, reusable), reply.itls)
        if not reply.ok:
            return "error"
        messages.append({"role": "assistant", "content": reply.text})
        if reply.usage_exact:
            context = reusable = reply.prompt_tokens + reply.completion_tokens
        else:
            context += turn.append_tokens + (reply.completion_tokens or 0)
            reusable = 0
        turn_index += 1
    return "turns"


async def _run_level(client, profile, cfg, sizer, shared_prefix, concurrency, progress) -> dict:
    from tqdm import tqdm

    plans = [SessionPlan(cfg, sizer, shared_prefix, concurrency, i) for i in range(concurrency)]
    before = await read_cache_counters(client)
    total = None if cfg.max_turns is None else concurrency * cfg.max_turns
    with tqdm(
        total=total, desc=f"concurrency {concurrency}", unit="req", disable=not progress, file=sys.stderr
    ) as bar:
        t0, cpu0 = time.perf_counter(), time.process_time()
        log = _LevelLog(t0, None if cfg.duration_s is None else t0 + cfg.duration_s, bar)
        ends = await asyncio.gather(*(_run_session(client, profile, p, i, log) for i, p in enumerate(plans)))
        duration = time.perf_counter() - t0
        client_cpu = (time.process_time() - cpu0) / duration
    after = await read_cache_counters(client)
    records = sorted(log.records, key=lambda r: (r["session"], r["turn"]))
    summary = summarize_level(records, duration, cfg.num_gpus, log.itls)
    summary["sessions_ended"] = {why: ends.count(why) for why in sorted(set(ends))}
    summary["server_cache"] = cache_deltas(before, after, summary["reusable_prompt_tokens"])
    summary["client_cpu_util"] = client_cpu
    if client_cpu > CLIENT_CPU_WARNING:
        print(
            f"[kestrel] concurrency {concurrency}: this process used {client_cpu:.0%} of a CPU core; the client "
            "may be limiting the measurement",
            file=sys.stderr,
        )
    return {"concurrency": concurrency, "sessions": concurrency, "summary": summary, "requests": records}


async def _sweep(cfg: AgentBenchConfig, progress: bool, transport, on_level) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(cfg.concurrency) + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=timeout, transport=transport
    ) as http:
        client = Client(http, cfg)
        profile = await connect(client, cfg)
        sizer = TextSizer(profile.chars_per_token, profile.tokenizer)
        shared_source = TextSource(random.Random(f"{cfg.seed}:shared"))
        shared_prefix = sizer.cut(shared_source.tool_spec, cfg.shared_prefix_tokens)
        result = {
            "benchmark": "kestrel bench agent",
            "kestrel_version": KESTREL_VERSION,
            "command": cfg.command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": _config_json(cfg),
            "server": {k: v for k, v in vars(profile).items() if k != "tokenizer"}
            | {"base_url": cfg.base_url},
            "definitions": DEFINITIONS,
            "levels": [],
        }
        for concurrency in cfg.concurrency:
            level = await _run_level(client, profile, cfg, sizer, shared_prefix, concurrency, progress)
            result["levels"].append(level)
            if on_level is not None:
                on_level(result)
        return result


def _config_json(cfg: AgentBenchConfig) -> dict:
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    out = {k: str(v) if isinstance(v, Spread) else v for k, v in out.items()}
    return out | {"api_key": "***" if cfg.api_key else None, "max_turns": cfg.max_turns}


def run_sweep(
    cfg: AgentBenchConfig,
    progress: bool = True,
    transport=None,
    on_level: Callable[[dict], None] | None = None,
) -> dict:
    """Run the sweep; `on_level(result so far)` after each level; `transport`: an httpx transport (tests)."""
    return asyncio.run(_sweep(cfg, progress, transport, on_level))
