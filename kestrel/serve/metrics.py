"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

A `Registry` holds counters, gauges and histograms and renders them for `GET /metrics`. Gauges (and counters
the engine already counts) may read their value from a callback at scrape time; with label names, the callback
returns {label values: value}. `ServerMetrics` declares the kestrel_* families and is fed by the HTTP layer as
outputs reach each request.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# 1, 2, 5, 10, 20, ... 5M tokens (vLLM's 1-2-5 steps)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
TOKEN_RATE_WINDOW_S = 10.0
TIERS = ("gpu", "host", "disk")


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _format_labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    escape = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{n}="{escape(v)}"' for n, v in zip(names, values)) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = (), fn: Callable | None = None):
        self.name, self.help, self.labelnames, self.fn = name, help, tuple(labelnames), fn

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        return lines + self._samples()

    def _samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A count that only goes up (or, with `fn`, a count kept elsewhere and read at scrape time)."""

    kind = "counter"

    def __init__(self, name, help, labelnames=(), fn=None):
        super().__init__(name, help, labelnames, fn)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("a counter cannot go down")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        return self._read().get(self._key(labels), 0.0)

    def _read(self) -> dict[tuple[str, ...], float]:
        if self.fn is None:
            return self._values
        return self.fn() if self.labelnames else {(): self.fn()}

    def _samples(self) -> list[str]:
        return [
            f"{self.name}{_format_labels(self.labelnames, k)} {_format_value(v)}"
            for k, v in self._read().items()
        ]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name, help, fn=None, labelnames=()):
        assert fn is not None or not labelnames, "a labelled gauge reads its values from `fn`"
        super().__init__(name, help, labelnames, fn)
        self._value = 0.0

    def set(self, value: float) -> None:
        self._value = float(value)

    def value(self) -> float:
        return float(self.fn()) if self.fn else self._value

    def _samples(self) -> list[str]:
        if self.labelnames:
            values = self.fn().items()
            return [f"{self.name}{_format_labels(self.labelnames, k)} {_format_value(v)}" for k, v in values]
        return [f"{self.name} {_format_value(self.value())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help, buckets=LATENCY_BUCKETS):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def _samples(self) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip((*self.buckets, math.inf), self._counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_format_value(bound)}"}} {cumulative}')
        lines.append(f"{self.name}_sum {_format_value(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Registry:
    def __init__(self, labels: dict[str, str] | None = None):
        """`labels`: put on every sample (the served model's name, as vLLM's and SGLang's `model_name`)."""
        self._metrics: dict[str, _Metric] = {}
        names, values = zip(*labels.items()) if labels else ((), ())
        self._labels = _format_labels(names, values)[1:-1]  # 'a="x",b="y"', or ""

    def add(self, metric: _Metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        return "".join(self._labelled(line) + "\n" for m in self._metrics.values() for line in m.render())

    def _labelled(self, line: str) -> str:
        """A sample line with the registry's labels first in its label set (HELP and TYPE lines as they are)."""
        if not self._labels or line.startswith("#"):
            return line
        name_end = min(i for i in (line.find("{"), line.find(" ")) if i >= 0)
        if line[name_end] == "{":
            return f"{line[: name_end + 1]}{self._labels},{line[name_end + 1 :]}"
        return f"{line[:name_end]}{{{self._labels}}}{line[name_end:]}"


class ServerMetrics:
    """The kestrel_* families. `stats` returns the engine's latest counters (`AsyncEngine.stats()`)."""

    def __init__(self, stats: Callable[[], dict], model_name: str | None = None):
        """`model_name`: the served model's name, a `model_name` label on every series (none without it)."""
        self.registry = r = Registry({"model_name": model_name} if model_name else None)
        self._stats = stats
        stat = lambda key: lambda: stats()[key]
        r.add(Gauge("kestrel_num_requests_running", "Requests holding a state slot.", stat("num_running")))
        r.add(Gauge("kestrel_num_requests_waiting", "Requests queued for a slot.", stat("num_queued")))
        r.add(
            Gauge(
                "kestrel_kv_pages_used",
                "KV cache pages in use: the requests' and the prefix cache's (kestrel_kv_pages_cached).",
                self._pages_used,
            )
        )
        # the part of it the cache frees on demand: without it, used pages never fell back after a load had gone
        r.add(
            Gauge(
                "kestrel_kv_pages_cached",
                "KV cache pages the prefix cache holds, given back when requests need them.",
                lambda: stats().get("num_cached_pages", 0),
            )
        )
        r.add(Gauge("kestrel_kv_pages_total", "KV cache pages in the pool.", stat("num_pages")))
        r.add(
            Gauge(
                "kestrel_kv_cache_usage_perc",
                "Share of the KV pages the requests hold (vLLM's; 1 is all): pages the prefix cache holds alone "
                "are free for this, since they come back on demand.",
                self._kv_usage,
            )
        )
        r.add(Gauge("kestrel_state_slots_used", "KDA state slots in use.", self._slots_used))
        r.add(Gauge("kestrel_state_slots_total", "KDA state slots in the pool.", stat("num_slots")))
        self.ttft = r.add(
            Histogram("kestrel_time_to_first_token_seconds", "Time from arrival to the first output token.")
        )
        self.itl = r.add(
            Histogram("kestrel_inter_token_latency_seconds", "Time between consecutive output tokens.")
        )
        self.e2e = r.add(
            Histogram("kestrel_e2e_request_latency_seconds", "Time from arrival to the last output token.")
        )
        self.queue_time = r.add(
            Histogram("kestrel_request_queue_time_seconds", "Time from arrival to the first admission.")
        )
        # vLLM's phases of a finished request (one choice), each from its first admission
        self.prefill_time, self.decode_time, self.inference_time = (
            r.add(Histogram(f"kestrel_request_{phase}_time_seconds", f"Time from {span}."))
            for phase, span in (
                ("prefill", "the first admission to the first output token"),
                ("decode", "the first output token to the last"),
                ("inference", "the first admission to the last output token"),
            )
        )
        self.request_prompt_tokens = r.add(
            Histogram(
                "kestrel_request_prompt_tokens", "Prompt tokens a finished prompt had.", buckets=TOKEN_BUCKETS
            )
        )
        self.request_generation_tokens = r.add(
            Histogram(
                "kestrel_request_generation_tokens",
                "Tokens a finished request (one choice) generated.",
                buckets=TOKEN_BUCKETS,
            )
        )
        self.prompt_tokens = r.add(
            Counter("kestrel_prompt_tokens_total", "Prompt tokens of finished requests.")
        )
        self.generation_tokens = r.add(Counter("kestrel_generation_tokens_total", "Generated tokens."))
        self.requests = r.add(
            Counter(
                "kestrel_requests_total",
                "Finished requests by finish reason, each of a request's n choices one.",
                ("finish_reason",),
            )
        )
        self.responses = r.add(
            Counter(
                "kestrel_http_responses_total",
                "HTTP responses by route and status code, refusals (400, 401, 413, 503) included.",
                ("route", "status"),
            )
        )
        r.add(
            Gauge(
                "kestrel_generation_tokens_per_second",
                f"Generated tokens per second over the last {TOKEN_RATE_WINDOW_S:g} s.",
                self._token_rate,
            )
        )
        r.add(
            Counter(
                "kestrel_num_preemptions_total",
                "Running requests retracted to free KV pages.",
                fn=stat("num_preemptions"),
            )
        )
        self._add_prefix_cache_metrics()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) within the rate window

    def _add_prefix_cache_metrics(self) -> None:
        """Per tier (gpu, host, disk): where cache hits came from, and what each tier holds. Zero without the
        prefix cache (or without the lower tiers)."""
        r = self.registry

        def by_tier(key: str) -> Callable[[], dict]:
            return lambda: {(tier,): self._stats().get(key.format(tier), 0) for tier in TIERS}

        r.add(
            Counter(
                "kestrel_prefix_cache_query_tokens_total",
                "Prompt tokens looked up in the prefix cache.",
                fn=lambda: self._stats().get("cache_query_tokens", 0),
            )
        )
        r.add(
            Counter(
                "kestrel_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache, by the tier their KV was in.",
                ("tier",),
                fn=by_tier("cache_{}_hit_tokens"),
            )
        )
        r.add(
            Gauge(
                "kestrel_prefix_cache_hit_rate",
                "Hit tokens over query tokens since start, by tier.",
                by_tier("cache_{}_hit_rate"),
                ("tier",),
            )
        )
        r.add(
            Gauge(
                "kestrel_prefix_cache_bytes_used",
                "Bytes the cache holds, by tier.",
                by_tier("cache_{}_bytes_used"),
                ("tier",),
            )
        )
        r.add(
            Gauge(
                "kestrel_prefix_cache_bytes",
                "Bytes each tier may hold.",
                by_tier("cache_{}_bytes"),
                ("tier",),
            )
        )
        r.add(
            Counter(
                "kestrel_prefix_cache_loads_total",
                "Loads of cached prefixes from a lower tier back to the GPU.",
                fn=lambda: self._stats().get("cache_num_loads", 0),
            )
        )
        checkpoints = {
            "gpu": "num_checkpoints_used",
            "host": "num_host_checkpoints",
            "disk": "num_disk_checkpoints",
        }
        r.add(
            Gauge(
                "kestrel_prefix_cache_checkpoints",
                "KDA checkpoints held, by tier (GPU: including the running requests' tracking slots).",
                lambda: {(tier,): self._stats().get(key, 0) for tier, key in checkpoints.items()},
                ("tier",),
            )
        )

    def render(self) -> str:
        return self.registry.render()

    # -- fed by the HTTP layer, on the event loop ------------------------------------------------------
    def on_tokens(self, arrival: float, first_time: float | None, last_time: float | None, num: int) -> None:
        """`num` new tokens of one request arrived now; `first_time`/`last_time`: its earlier tokens, if any."""
        if num <= 0:
            return
        now = time.monotonic()
        if first_time is None:
            self.ttft.observe(now - arrival)
        elif last_time is not None:
            for _ in range(num):
                self.itl.observe((now - last_time) / num)
        self.generation_tokens.inc(num)
        self._recent.append((now, num))
        self._prune(now)

    def on_finished(
        self,
        arrival: float,
        num_prompt_tokens: int,
        finish_reason: str | None,
        num_generated: int = 0,
        times: tuple[float | None, float | None, float | None] = (None, None, None),
    ) -> None:
        """One engine request (one choice) finished; `num_prompt_tokens` is 0 for all but the last choice of a
        prompt sampled n times, so that the prompt counts once. `times`: when it was first admitted, and its
        first and last output tokens came (time.monotonic; None where that did not happen)."""
        self.e2e.observe(time.monotonic() - arrival)
        scheduled, first, last = times
        if scheduled is not None and first is not None:
            self.prefill_time.observe(first - scheduled)
            self.decode_time.observe(last - first)
            self.inference_time.observe(last - scheduled)
        self.prompt_tokens.inc(num_prompt_tokens)
        if num_prompt_tokens:
            self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generated)
        self.requests.inc(finish_reason=finish_reason or "unknown")

    def on_admitted(self, queue_time: float) -> None:
        """One engine request was admitted `queue_time` seconds after it arrived (once each, aborted or not)."""
        self.queue_time.observe(queue_time)

    # -- read at scrape time -----------------------------------------------------------------------------------
    def _pages_used(self) -> int:
        s = self._stats()
        return s["num_pages"] - s["num_free_pages"]

    def _kv_usage(self) -> float:
        s = self._stats()
        return s["num_pages_in_use"] / max(1, s["num_pages"])

    def _slots_used(self) -> int:
        s = self._stats()
        return s["num_slots"] - s["num_free_slots"]

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - TOKEN_RATE_WINDOW_S:
            self._recent.popleft()

    def _token_rate(self) -> float:
        self._prune(time.monotonic())
        return sum(n for _, n in self._recent) / TOKEN_RATE_WINDOW_S


class CountResponses:
    """ASGI middleware: each HTTP response into `counter` (kestrel_http_responses_total) by its route's path
    template (not the raw path: one label a route) and status; an exception before the response started counts as
    the 500 the server answers with. Plain ASGI rather than a BaseHTTPMiddleware, which stands between the
    endpoints and the client's disconnect messages that abort requests."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._count(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                self._count(scope, 500)
            raise

    def _count(self, scope, status: int) -> None:
        route = scope.get("route")  # set by the router once it matched one
        self.counter.inc(route=getattr(route, "path", "unmatched"), status=status)
