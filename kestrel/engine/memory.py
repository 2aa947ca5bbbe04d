"""The engine's memory plan: state slots (one per running request), then the prefix cache's KDA checkpoints,
then KV pages from what is left, on the GPU from its free memory after a reserve for activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.cache.kv_pool import KVPool
from kestrel.cache.state_pool import StatePool
from kestrel.config import EngineConfig, ModelConfig
from kestrel.env import read_env
from kestrel.utils.errors import ConfigError, KestrelError

_CPU_KV_BYTES = 256 * 2**20


@dataclass(frozen=True)
class MemoryPlan:
    num_slots: int
    num_pages: int
    page_size: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    max_model_len: int
    num_checkpoints: int = 0  # prefix cache: KDA state checkpoint slots (each the size of a state slot)

    def describe(self) -> str:
        gib = 2**30
        return (
            f"memory plan: {self.num_slots} state slots x {self.state_bytes_per_slot / 2**20:.2f} MiB "
            f"= {self.num_slots * self.state_bytes_per_slot / gib:.3f} GiB; {self.num_pages} KV pages x "
            f"{self.page_size} tokens = {self.num_pages * self.page_size} tokens x {self.kv_bytes_per_token} B "
            f"= {self.num_pages * self.page_size * self.kv_bytes_per_token / gib:.3f} GiB; "
            f"{self.num_checkpoints} prefix-cache checkpoints = "
            f"{self.num_checkpoints * self.state_bytes_per_slot / gib:.3f} GiB; "
            f"bytes per request = {self.state_bytes_per_slot} + {self.kv_bytes_per_token} per token; "
            f"max context {self.max_model_len} tokens"
        )


def check_max_model_len(model: ModelConfig, cfg: EngineConfig) -> None:
    """A max_model_len past the model's own limit is refused (it was cut to that limit with a log line, so the
    context asked for was silently not there); None takes the model's."""
    if cfg.max_model_len is not None and cfg.max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {cfg.max_model_len} is past the model's context limit of "
            f"{model.max_position_embeddings} tokens: give at most {model.max_position_embeddings}, or leave "
            "max_model_len out for the model's limit"
        )


def plan_memory(
    model: ModelConfig, cfg: EngineConfig, dtype: torch.dtype, device: torch.device
) -> MemoryPlan:
    """Slots first (one per running request), then the prefix cache's checkpoints, then KV pages from the
    remaining budget."""
    per_token = max(KVPool.bytes_per_token(model, dtype, cfg.index_key_dtype == "fp8"), 1)
    per_slot = StatePool.bytes_per_slot(model, dtype)
    # The prefix cache's KDA checkpoints (each the size of a state slot): at least 4 per running request (an
    # agent session keeps its interval checkpoints and the ends of its turns) and 16; on the GPU, by default,
    # up to an eighth of the cache's memory, so that a cache with room for many sessions' KV has room for
    # their checkpoints too.
    checkpoints = (
        (cfg.num_checkpoints or max(16, 4 * cfg.max_running_requests)) if cfg.enable_prefix_cache else 0
    )
    state = (cfg.max_running_requests + checkpoints) * per_slot
    check_max_model_len(model, cfg)
    max_len = cfg.max_model_len or model.max_position_embeddings
    if cfg.kv_cache_bytes is not None:
        kv_bytes = cfg.kv_cache_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # Room for activations, with a generous margin: a prefill chunk's hidden states and its MoE and
        # attention intermediates (64 B per hidden unit; the KDA layers' checkpoint segments at most double the
        # chunk), its indexer scores and top-k workspace over the whole context with DSA (8 B per pair; the
        # expanded sparse prefill's per-head keys and values, 8 KiB a history row at mini, and its selection
        # bitmap, 1/8 B per pair, come after the scores are freed and fit in their room), and the fp32 logits
        # of the rows that sample (only those get logits).
        chunk = cfg.chunk_size(device.type)
        reserve = (
            2 * 2**30
            + 128 * chunk * model.hidden_size
            + (8 * chunk * max_len if model.use_dsa else 0)
            + 16 * cfg.max_running_requests * model.vocab_size
        )
        if read_env().attn_backend == "torch":
            # The torch decode path gathers every running request's padded history (fp32 copies included);
            # the Triton kernels read the pages in place.
            reserve += (
                6
                * cfg.max_running_requests
                * max_len
                * (model.kv_cache_dim + (model.index_head_dim or 0))
                * 4
            )
        kv_bytes = int((free - state - reserve) * cfg.mem_fraction)
        if cfg.enable_prefix_cache and cfg.num_checkpoints is None:
            more = max(0, (kv_bytes + checkpoints * per_slot) // 8 // per_slot - checkpoints)
            checkpoints, kv_bytes = checkpoints + more, kv_bytes - more * per_slot
    else:
        kv_bytes = _CPU_KV_BYTES
    num_pages = kv_bytes // (cfg.page_size * per_token)
    if not cfg.enable_prefix_cache and cfg.kv_cache_bytes is None:
        # without a prefix cache, never take more pages than the running requests can fill; with one, the
        # pages past that hold the cached prefixes
        num_pages = min(num_pages, cfg.max_running_requests * -(-max_len // cfg.page_size) + 1)
    if num_pages < 1:
        raise KestrelError(
            f"no memory left for KV pages after {cfg.max_running_requests} state slots and {checkpoints} "
            f"checkpoints ({state / 2**30:.2f} GiB): lower --max-running-requests or --num-checkpoints, or raise "
            f"--mem-fraction"
        )
    limit = min(model.max_position_embeddings, num_pages * cfg.page_size)
    if cfg.max_model_len is not None:
        limit = min(limit, cfg.max_model_len)
    return MemoryPlan(
        cfg.max_running_requests, num_pages, cfg.page_size, per_token, per_slot, limit, checkpoints
    )
