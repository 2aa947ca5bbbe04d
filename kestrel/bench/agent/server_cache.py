"""The server's prefix-cache counters (Kestrel's `/get_server_info`, Prometheus `/metrics`) and their
change over a level, per tier."""

from __future__ import annotations

import re

from kestrel.bench.agent.client import Client


def _flatten(obj, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts and lists, keyed by dotted paths."""
    out: dict[str, float] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text samples summed over labels (histogram and summary series left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if m is None or m.group(1).endswith(("_bucket", "_sum", "_count")):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


def _cache_keys(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if "hit" in k or "quer" in k}


async def read_cache_counters(client: Client) -> dict[str, dict[str, float]]:
    """The server's cache counters: {"server_info": {...}, "metrics": {...}} (empty where absent)."""
    info = await client.get_json(f"{client.root}/get_server_info")
    stats = info.get("stats", info) if info else {}
    metrics = {}
    resp = await client.get(f"{client.root}/metrics")
    if resp is not None and resp.status_code == 200:
        metrics = _parse_prometheus(resp.text)
    return {"server_info": _cache_keys(_flatten(stats)), "metrics": _cache_keys(metrics)}


def _query_key_for(hit_key: str, keys) -> str | None:
    for a, b in (("hit_tokens", "query_tokens"), ("hits", "queries"), ("hit", "query")):
        if a in hit_key and hit_key.replace(a, b) in keys:
            return hit_key.replace(a, b)
    return None


def cache_deltas(before: dict, after: dict, reusable_tokens: int) -> dict | None:
    """The server's cache hits over a level, from its counters before and after.

    Every hit counter with a query counter beside it (`x_hit_tokens`/`x_query_tokens`, `x_hits`/`x_queries`)
    is a tier; a hit counter without one is measured against the main query counter. The main tier is
    Kestrel's `cache_hit_tokens` where present. `reported` keeps the server's own (cumulative) hit rates.
    None when the server exposes no cache counters."""
    tiers, reported, main = {}, {}, None
    for source in ("server_info", "metrics"):
        b, a = before.get(source) or {}, after.get(source) or {}
        reported.update({f"{source}:{k}": v for k, v in a.items() if "hit_rate" in k})
        hit_keys = [k for k in a if "hit" in k and "rate" not in k and k in b]
        pairs = {k: _query_key_for(k, a) for k in hit_keys}
        for hit_key, query_key in pairs.items():
            if query_key is None or query_key not in b:
                continue
            tier = _tier(a[hit_key] - b[hit_key], a[query_key] - b[query_key])
            tiers[f"{source}:{hit_key}"] = tier
            if main is None or hit_key == "cache_hit_tokens":
                main = tier
        if main is not None:
            for hit_key, query_key in pairs.items():  # lower tiers counted against the main queries
                if query_key is None:
                    tiers[f"{source}:{hit_key}"] = _tier(a[hit_key] - b[hit_key], main["query_tokens"])
    if main is None and not reported:
        return None
    out = {"hit_rate": None, "hit_tokens": None, "query_tokens": None, "hit_of_reusable": None}
    if main is not None:
        out.update(main)
        out["hit_of_reusable"] = main["hit_tokens"] / reusable_tokens if reusable_tokens else None
    return {**out, "tiers": tiers, "reported": reported}


def _tier(hits: float, queries: float) -> dict:
    return {"hit_tokens": hits, "query_tokens": queries, "hit_rate": hits / queries if queries > 0 else None}
