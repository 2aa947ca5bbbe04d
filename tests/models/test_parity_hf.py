"""Parity with transformers' KimiLinearForCausalLM, the anchor nobody here wrote.

Random tiny Kimi-Linear configs are built and saved by transformers, loaded by Kestrel, and the float32 logits
compared on prompts of several lengths (max |a - b| / max |a| <= 1e-4): full forward, and prefill followed by
token-by-token decode through both caches. Both checkpoint layouts are read (the Moonshot names transformers
writes, and transformers' own module names), and Kestrel's kimi_linear writer is read back by transformers.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kestrel.config import ModelConfig
from kestrel.layers.context import forward_context
from kestrel.models.cache import DenseCache
from kestrel.models.loader import build_model
from kestrel.models.weights import save_checkpoint
from tests.hf_reference import torch_only_kimi_linear

TOL = 1e-4
LENGTHS = (1, 7, 33, 100)  # 100 > fla's chunk of 64: multi-chunk prefill

CASES = {
    # q_proj (no q-LoRA), grouped top-k (4 groups, keep 2), one shared expert, first layer dense
    "nolora_grouped": dict(
        q_lora_rank=None, kda=[1, 2, 3, 5], full=[4, 6], n_group=4, topk_group=2, shared=1, first_dense=1
    ),
    # q-LoRA, full attention first, two shared experts, no dense layer
    "lora_mla_first": dict(
        q_lora_rank=24, kda=[2, 3, 4], full=[1], n_group=1, topk_group=1, shared=2, first_dense=0
    ),
    # alternating pattern, two dense layers up front
    "alternating": dict(
        q_lora_rank=16, kda=[1, 3, 5], full=[2, 4, 6], n_group=2, topk_group=1, shared=1, first_dense=2
    ),
}


def _hf_model(case: dict, seed: int):
    mod = torch_only_kimi_linear()
    from transformers import KimiLinearConfig

    n_layers = len(case["kda"]) + len(case["full"])
    cfg = KimiLinearConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=n_layers,
        num_attention_heads=3,
        num_key_value_heads=3,
        kv_lora_rank=20,
        q_lora_rank=case["q_lora_rank"],
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=case["shared"],
        n_group=case["n_group"],
        topk_group=case["topk_group"],
        routed_scaling_factor=2.446,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        first_k_dense_replace=case["first_dense"],
        linear_attn_config={
            "head_dim": 16,
            "num_heads": 3,
            "short_conv_kernel_size": 4,
            "kda_layers": case["kda"],
            "full_attn_layers": case["full"],
        },
    )
    torch.manual_seed(seed)
    model = mod.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # larger random weights than the 0.02 init, so every nonlinearity matters
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return mod, model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    mod, hf = _hf_model(CASES[request.param], seed=sorted(CASES).index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, mod, hf, path


def test_full_forward_logits_match(pair):
    name, _, hf, path = pair
    ours = build_model(str(path))
    g = torch.Generator().manual_seed(0)
    for T in LENGTHS:
        ids = torch.randint(3, 97, (T,), generator=g)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
            got = ours(ids)
        err = _rel(ref, got)
        print(f"parity[{name}] T={T}: max rel err {err:.2e}")
        assert err <= TOL, f"{name}, T={T}: rel err {err:.2e}"


def test_decode_through_caches_matches(pair):
    """Prefill 9 tokens, then 6 single-token steps: Kestrel's dense cache vs transformers' DynamicCache."""
    name, _, hf, path = pair
    ours = build_model(str(path))
    ids = torch.randint(3, 97, (15,), generator=torch.Generator().manual_seed(1))
    cache = DenseCache(ours.config, 1, 32, torch.float32, "cpu")
    with torch.no_grad():
        out = hf(ids[None, :9], use_cache=True)
        # transformers 5.24 names the cache `cache`, 5.17 (the GPU image) `past_key_values`
        key = "cache" if hasattr(out, "cache") else "past_key_values"
        hf_cache, ref_steps = getattr(out, key), [out.logits[0, -1]]
        for t in range(9, 15):
            out = hf(ids[None, t : t + 1], use_cache=True, **{key: hf_cache})
            hf_cache = getattr(out, key)
            ref_steps.append(out.logits[0, -1])
        got_steps = []
        for piece in [ids[:9]] + [ids[t : t + 1] for t in range(9, 15)]:
            ctx = cache.context([0], [len(piece)])
            with forward_context(ctx):
                got_steps.append(ours(piece)[-1])
            cache.commit(ctx)
    for step, (ref, got) in enumerate(zip(ref_steps, got_steps)):
        err = _rel(ref, got)
        assert err <= TOL, f"{name}, decode step {step}: rel err {err:.2e}"


def test_transformers_module_layout_loads(pair, tmp_path):
    """transformers' in-memory names (fused conv1d, forget_gate.*, stacked experts) load to the same model."""
    name, _, hf, path = pair
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours = build_model(str(tmp_path))
    ids = torch.arange(3, 40)
    with torch.no_grad():
        assert _rel(hf(ids[None]).logits[0], ours(ids)) <= TOL


def test_kestrel_writer_loads_in_transformers(pair, tmp_path):
    name, mod, hf, path = pair
    ours = build_model(str(path))
    save_checkpoint(ours, tmp_path)
    assert ModelConfig.from_hf(tmp_path) == ours.config
    back = mod.KimiLinearForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.arange(3, 60)
    with torch.no_grad():
        assert _rel(hf(ids[None]).logits[0], back(ids[None]).logits[0]) <= TOL
