"""The dense MLA prefill's runs (neighbouring fresh sequences of one length attending in one call,
`MLAttention._fresh_dense_runs`): their latent rows in one read; on CUDA, the tokens of the same prefill one
sequence at a time. The CPU's check of the engine's path, through Triton's interpreter, is
tests/engine/test_triton_decode_path.py."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_read_kv_run_equals_each_sequence_read():
    """A run's latent rows in one gather equal each sequence's own read (pages out of order, a last page part
    full); a read without `index` brings no indexer keys."""
    from kestrel.cache.kv_pool import KVPool
    from kestrel.cache.view import PagedCacheView
    from kestrel.presets import preset_config

    config = preset_config("tiny")  # DSA: indexer keys beside the latent rows
    pool = KVPool(config, num_pages=12, page_size=4, dtype=torch.float32, device="cpu")
    layer = config.mla_layer_ids[0]
    g = torch.Generator().manual_seed(0)
    pool.kv[layer].copy_(torch.randn(pool.kv[layer].shape, generator=g))
    pool.index_k[layer].copy_(torch.randn(pool.index_k[layer].shape, generator=g))
    table = torch.tensor([[3, 7, 1], [2, 9, 11], [5, 4, 6]])  # 10 tokens each: 3 pages of 4
    none = torch.empty(0, dtype=torch.int64)
    view = PagedCacheView(pool, None, none, none, page_table=table, lens=torch.full((3,), 10), ends=[10] * 3)
    run = view.read_kv_run(layer, 1, 2, 10)
    assert run.shape == (2, 10, config.kv_cache_dim)
    for j, seq in enumerate((1, 2)):
        assert torch.equal(run[j], view.read_kv(layer, seq)[0])
    assert view.read_kv(layer, 0, index=False)[1] is None
    assert view.read_kv(layer, 0)[1].shape == (10, config.index_head_dim)


def _tokens(model, prompts) -> dict:
    from kestrel.config import EngineConfig
    from kestrel.engine.engine import Engine
    from kestrel.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model="tiny", page_size=16, chunked_prefill_size=512), model=model)
    out: dict = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), str(i))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.gpu
@requires_cuda
def test_runs_give_the_tokens_of_one_sequence_at_a_time(monkeypatch):
    from kestrel.layers.mla import MLAttention
    from kestrel.models.kimi import KimiForCausalLM
    from kestrel.models.loader import init_random_weights
    from kestrel.presets import preset_config

    monkeypatch.setenv("KESTREL_ATTN_BACKEND", "triton")
    with torch.device("cuda"):
        model = KimiForCausalLM(preset_config("tiny", "kimi_linear"), torch.float32)  # MLA without DSA
    init_random_weights(model, seed=7, rng_device="cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 40, 40, 24, 24, 17)]
    runs = []
    real = MLAttention._fresh_dense_runs
    monkeypatch.setattr(
        MLAttention, "_fresh_dense_runs", lambda self, *a: runs.append(real(self, *a)) or runs[-1]
    )
    grouped = _tokens(model, prompts)
    assert runs[0] == {0: (3, 40), 3: (2, 24)}, runs[:2]  # the first step's first MLA layer
    monkeypatch.setattr(MLAttention, "_fresh_dense_runs", lambda self, *a: {})
    assert _tokens(model, prompts) == grouped
