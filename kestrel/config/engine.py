"""`EngineConfig`: how the serving engine runs a model (the CLI and `LLM(...)` build one)."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.utils.errors import ConfigError

# Tokens a step by default, by device type. On the CPU a prefill step costs more than in proportion to its tokens
# (the demo model, one 8,184-token prompt: one 8192-token step 34.7 s; 512-token steps 16.9 s in all, the longest
# 1.9 s), and every running stream waits for it: smaller steps are faster and stall the streams less.
DEFAULT_CHUNK = {"cuda": 8192, "cpu": 512}


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model: the serving engine's settings (the CLI and `LLM(...)` build one)."""

    model: str = "tiny"  # checkpoint folder or preset name (random weights)
    tokenizer: str | None = (
        None  # folder with tokenizer.json; default: the model folder, else the byte tokenizer
    )
    # a Jinja chat template (or a file holding one) used instead of the tokenizer's own (vLLM's --chat-template)
    chat_template: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)
    device: str = "auto"
    seed: int = 0  # random-weight presets
    max_running_requests: int = 64  # = KDA state slots
    page_size: int = 64
    index_key_dtype: str = (
        "auto"  # DSA indexer keys in the KV pool: auto (the model dtype) | fp8 (E4M3 + scale)
    )
    mem_fraction: float = 0.85  # of the GPU memory free after weights and state slots, for KV pages
    kv_cache_bytes: int | None = None  # explicit KV budget (default on CPU: 256 MiB)
    max_model_len: int | None = None  # at most the model's context limit (default: it, capped by the KV pool)
    # tokens per step (prefill chunks + decode tokens); None: `DEFAULT_CHUNK` by the device (`chunk_size`)
    chunked_prefill_size: int | None = None
    disable_cuda_graph: bool = False
    # launch each decode step before the one in front of it is read back (Engine's overlap schedule)
    disable_overlap_schedule: bool = False
    cuda_graph_max_bs: int = 256
    # decode graphs this many tokens wide beside those of the whole context limit, for steps whose contexts all
    # fit (kestrel.engine.runner.graph_widths; none where the limit is below twice this); 0: graphs of the whole
    # limit only
    cuda_graph_short_len: int = 8192
    max_queued_requests: int = 4096  # server: past this many waiting requests, answer 503
    enable_prefix_cache: bool = True  # radix tree over KV pages + KDA state checkpoints
    # save a KDA checkpoint every this many prefill tokens (a multiple of pages; chunks end there): by default
    # the chunk size, so that a long prefill's chunks are not cut shorter
    checkpoint_interval: int = 8192
    num_checkpoints: int | None = (
        None  # checkpoint slots (default: 4 per running request, at least 16; on the GPU up to 1/8 of the cache memory)
    )
    # HiCache: what the GPU evicts from the prefix cache goes to host memory, and from there to disk.
    hicache_host_bytes: int = 0  # host tier size (pinned with CUDA); 0 = off
    hicache_disk_dir: str | None = None  # disk tier folder (below the host tier); None = no disk tier
    hicache_disk_bytes: int = 0  # disk tier size cap

    def chunk_size(self, device_type: str) -> int:
        """Tokens a step on this device: `chunked_prefill_size`, or the device's default (`DEFAULT_CHUNK`), at
        least twice the running requests (their decode tokens come out of the budget first: past it, no prompt
        would be prefilled until some finished)."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return max(DEFAULT_CHUNK.get(device_type, DEFAULT_CHUNK["cuda"]), 2 * self.max_running_requests)

    def __post_init__(self):
        problems = []
        if not -(2**63) <= self.seed < 2**63:  # torch's generator takes an int64 ("Overflow when unpacking")
            problems.append(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed}")
        if self.max_running_requests < 1:
            problems.append("max_running_requests must be >= 1")
        if self.page_size < 1:
            problems.append("page_size must be >= 1")
        if not 0 < self.mem_fraction <= 1:
            problems.append("mem_fraction must be in (0, 1]")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            problems.append("kv_cache_bytes must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append("max_model_len must be >= 2")
        if self.cuda_graph_short_len < 0:
            problems.append("cuda_graph_short_len must be >= 0")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            problems.append("chunked_prefill_size must be >= 1")
        if self.max_queued_requests < 1:
            problems.append("max_queued_requests must be >= 1")
        if self.checkpoint_interval < 0 or (
            self.checkpoint_interval and self.page_size >= 1 and self.checkpoint_interval % self.page_size
        ):
            problems.append(
                f"checkpoint_interval ({self.checkpoint_interval}) must be a multiple of page_size "
                f"({self.page_size}): a page size dividing it, such as a power of 2, or another interval "
                "(0 = no checkpoints)"
            )
        if self.num_checkpoints is not None and self.num_checkpoints < 1:
            problems.append("num_checkpoints must be >= 1")
        if self.index_key_dtype not in ("auto", "fp8"):
            problems.append(f"index_key_dtype {self.index_key_dtype!r} must be auto or fp8")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"dtype {self.dtype!r} must be auto, float32, bfloat16 or float16")
        if self.hicache_host_bytes < 0 or self.hicache_disk_bytes < 0:
            problems.append("hicache_host_bytes and hicache_disk_bytes must be >= 0")
        if self.hicache_host_bytes and not self.enable_prefix_cache:
            problems.append("the hicache tiers extend the prefix cache: enable_prefix_cache must be on")
        if (self.hicache_disk_dir is None) != (self.hicache_disk_bytes == 0):
            problems.append("hicache_disk_dir and hicache_disk_bytes go together (both set, or neither)")
        if self.hicache_disk_dir is not None and not self.hicache_host_bytes:
            problems.append("the hicache disk tier sits below the host tier: set hicache_host_bytes too")
        if problems:
            raise ConfigError("; ".join(problems))
