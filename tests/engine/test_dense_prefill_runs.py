"""On CUDA, the dense MLA prefill's runs (neighbouring fresh sequences of one length attending in one call,
`MLAttention._fresh_dense_runs`) give the tokens of the same prefill one sequence at a time. The CPU's check of
the same path, through Triton's interpreter, is tests/engine/test_triton_decode_path.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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
    assert any(r for r in runs), "no run taken"
    monkeypatch.setattr(MLAttention, "_fresh_dense_runs", lambda self, *a: {})
    assert _tokens(model, prompts) == grouped
