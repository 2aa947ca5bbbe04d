"""A server with the host and disk cache tiers: prefixes evicted from the GPU come back from them (visible per
tier in /get_server_info and /metrics), and POST /flush_cache empties every tier."""

from __future__ import annotations

import time

import httpx
import pytest

from kestrel.serve.cli import _engine_config, build_parser
from kestrel.utils.errors import KestrelError
from tests.serve.conftest import metric_samples

BLOCK = 16 * 448  # one 16-token KV page of `tiny` (fp32) for every MLA layer


def _generate(server, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _metric(text: str, name: str) -> float:
    return metric_samples(text)[name]


def test_lower_tier_hits_metrics_and_flush(make_server, tmp_path):
    s = make_server(
        kv_cache_bytes=12 * BLOCK,  # 12 pages: room for two of the four sessions below
        max_running_requests=2,
        num_checkpoints=2,
        hicache_host_bytes=8 * BLOCK,
        hicache_disk_dir=str(tmp_path),
        hicache_disk_bytes=200 * BLOCK,
    )
    sessions = [[(7 * s + i) % 250 for i in range(70)] for s in range(4)]
    first = [_generate(s, ids) for ids in sessions]
    again = [_generate(s, ids) for ids in sessions]
    assert again == first

    stats = s.info()["stats"]
    assert stats["hicache"] and stats["cache_num_loads"] > 0
    lower = stats["cache_host_hit_tokens"] + stats["cache_disk_hit_tokens"]
    assert lower > 0 and lower + stats["cache_gpu_hit_tokens"] == stats["cache_hit_tokens"]
    assert stats["cache_host_bytes"] == 8 * BLOCK and stats["cache_disk_bytes"] == 200 * BLOCK
    metrics = httpx.get(f"{s.url}/metrics").text
    hits = sum(
        _metric(metrics, f'kestrel_prefix_cache_hit_tokens_total{{tier="{t}"}}') for t in ("host", "disk")
    )
    assert hits == lower
    assert (
        _metric(metrics, 'kestrel_prefix_cache_bytes_used{tier="disk"}') == stats["cache_disk_bytes_used"] > 0
    )
    assert _metric(metrics, "kestrel_prefix_cache_loads_total") == stats["cache_num_loads"]
    assert 'kestrel_prefix_cache_checkpoints{tier="host"}' in metric_samples(metrics)

    r = httpx.post(f"{s.url}/flush_cache", timeout=30)
    assert r.status_code == 200
    flushed = r.json()
    assert flushed["flushed_pages"] > 0 and flushed["flushed_disk_bytes"] == stats["cache_disk_bytes_used"]
    assert set(flushed) == {
        "flushed_pages",
        "flushed_checkpoints",
        "flushed_host_bytes",
        "flushed_disk_bytes",
    }
    deadline = time.monotonic() + 10
    while (stats := s.info()["stats"])["cache_disk_bytes_used"] or stats["num_cached_pages"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert stats["cache_host_bytes_used"] == 0 and not list(tmp_path.rglob("*.bin"))
    assert _generate(s, sessions[0]) == first[0]  # still serving, from scratch


def test_flush_cache_without_a_prefix_cache(make_server):
    s = make_server(enable_prefix_cache=False)
    r = httpx.post(f"{s.url}/flush_cache", timeout=30)
    assert r.status_code == 200 and r.json()["flushed_pages"] == 0
    assert s.info()["stats"]["prefix_cache"] is False


def test_serve_flags_reach_the_engine_config(tmp_path):
    def config(*argv):
        return _engine_config(build_parser().parse_args(["serve", *argv]))

    c = config(
        "--hicache-host-gb", "0.5", "--hicache-disk-dir", str(tmp_path), "--hicache-disk-gb", "2",
        "--checkpoint-interval", "128", "--num-checkpoints", "32",
    )  # fmt: skip
    assert (c.hicache_host_bytes, c.hicache_disk_dir, c.hicache_disk_bytes) == (2**29, str(tmp_path), 2**31)
    assert (c.checkpoint_interval, c.num_checkpoints, c.enable_prefix_cache) == (128, 32, True)
    assert not config("--disable-prefix-cache").enable_prefix_cache
    assert not c.disable_overlap_schedule and config("--disable-overlap-schedule").disable_overlap_schedule
    # EngineConfig's messages name its fields; the command line's name the flags
    with pytest.raises(KestrelError, match="^--hicache-disk-dir and --hicache-disk-gb go together"):
        config("--hicache-host-gb", "1", "--hicache-disk-dir", str(tmp_path))
    with pytest.raises(KestrelError, match="set --hicache-host-gb too$"):
        config("--hicache-disk-dir", str(tmp_path), "--hicache-disk-gb", "1")
    with pytest.raises(KestrelError, match="prefix cache: leave out --disable-prefix-cache$"):
        config("--hicache-host-gb", "1", "--disable-prefix-cache")
    with pytest.raises(
        KestrelError, match=r"^--checkpoint-interval \(96\) must be a multiple of --page-size \(64\)"
    ):
        config("--checkpoint-interval", "96")
    with pytest.raises(KestrelError, match="^--max-model-len must be >= 2$"):
        config("--max-model-len", "1")
