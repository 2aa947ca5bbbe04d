"""The engine's memory plan on a GPU, with the device's free memory faked (plan_memory only asks
torch.cuda.mem_get_info and does arithmetic): slots, then the prefix cache's KDA checkpoints, then KV pages."""

from __future__ import annotations

import pytest
import torch

from kestrel.cache.kv_pool import KVPool
from kestrel.cache.state_pool import StatePool
from kestrel.config import EngineConfig
from kestrel.engine.memory import plan_memory
from kestrel.presets import preset_config
from kestrel.utils.errors import ConfigError, KestrelError

GIB = 2**30
CUDA = torch.device("cuda")


@pytest.fixture
def free_gib(monkeypatch):
    """Set the faked free GPU memory (GiB)."""
    state = {"free": 100}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"] * GIB, 141 * GIB))
    return lambda gib: state.update(free=gib)


def _plan(model: str = "mini", **kw):
    config = preset_config(model)
    return config, plan_memory(config, EngineConfig(model=model, **kw), torch.bfloat16, CUDA)


def test_checkpoints_take_up_to_an_eighth_of_the_cache(free_gib):
    config, plan = _plan(max_running_requests=16, max_model_len=20000)
    per_slot = StatePool.bytes_per_slot(config, torch.bfloat16)
    kv = plan.num_pages * plan.page_size * plan.kv_bytes_per_token
    cache = kv + plan.num_checkpoints * per_slot
    assert plan.num_checkpoints > 4 * 16  # more than the floor: the GPU has room
    assert plan.num_checkpoints * per_slot == pytest.approx(cache / 8, rel=0.01)
    # with the cache on, pages are not capped at what the running requests fill (the rest holds prefixes)
    assert plan.num_pages > 16 * -(-20000 // plan.page_size) + 1


def test_without_prefix_cache_no_checkpoints_and_pages_capped(free_gib):
    _, plan = _plan(max_running_requests=16, max_model_len=20000, enable_prefix_cache=False)
    assert plan.num_checkpoints == 0 and plan.num_pages == 16 * -(-20000 // plan.page_size) + 1


def test_explicit_sizes_are_kept(free_gib):
    config, plan = _plan(max_running_requests=8, kv_cache_bytes=GIB // 4, num_checkpoints=10)
    assert plan.num_checkpoints == 10
    assert plan.num_pages == GIB // 4 // (plan.page_size * KVPool.bytes_per_token(config, torch.bfloat16))


def test_indexer_reserve_only_with_dsa(free_gib):
    """The reserve for a chunk's indexer scores over the whole context applies to DSA models only."""
    # the prefix cache on with a set number of checkpoints: no cap on the pages, no eighth for checkpoints
    cfg = EngineConfig(model="mini", chunked_prefill_size=8192, max_running_requests=64, num_checkpoints=16)
    dsa, dense = preset_config("mini"), preset_config("mini", "kimi_linear")  # the same model without DSA
    assert dsa.use_dsa and not dense.use_dsa
    plans = [plan_memory(c, cfg, torch.bfloat16, CUDA) for c in (dsa, dense)]
    kv_bytes = [p.num_pages * p.page_size * p.kv_bytes_per_token for p in plans]
    # 8 B per (chunk token, context position): 8 x 8192 x 131072 = 8 GiB more reserved with DSA
    assert kv_bytes[1] - kv_bytes[0] == pytest.approx(0.85 * 8 * 8192 * 131072, rel=0.01)


def test_too_little_memory_names_the_knobs(free_gib):
    free_gib(3)
    with pytest.raises(KestrelError, match="max-running-requests"):
        _plan(max_running_requests=256)


def test_a_limit_past_the_models_positions_is_refused(free_gib):
    """An explicit max_model_len past the model's limit is an error naming both (it was cut to the model's limit
    with only a log line); the limit itself, or none, is the model's."""
    config = preset_config("tiny")
    limit = config.max_position_embeddings
    with pytest.raises(
        ConfigError, match=f"max_model_len {limit + 1} is past the model's context limit of {limit}"
    ):
        plan_memory(config, EngineConfig(model="tiny", max_model_len=limit + 1), torch.bfloat16, CUDA)
    for asked in (limit, None):
        plan = plan_memory(config, EngineConfig(model="tiny", max_model_len=asked), torch.bfloat16, CUDA)
        assert plan.max_model_len == limit
