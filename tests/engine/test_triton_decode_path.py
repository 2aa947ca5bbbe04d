"""The engine's decode through the Triton kernels (paged indexer scores, exact top-k, sparse MLA) gives the same
tokens as the torch path, and so does the fast decode step (fla-core's in-place state-slot recurrence, the Triton
conv step, Triton attention), with the conv step and the output gates inside the rows GEMV too. On CPU the kernels
run in Triton's interpreter, in a subprocess, because TRITON_INTERPRET must be set before Triton is first
imported."""

from __future__ import annotations

import json
import sys

import pytest

from tests import early

pytest.importorskip("triton")
import torch  # noqa: E402

# The CPU's check of the Triton paths, through Triton's interpreter. On a CUDA machine the compiled kernels are
# checked against their references in tests/ops (and the device image's Triton 3.6 interpreter cannot run
# them: "only 0-dimensional arrays can be converted to Python scalars").
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's check")

SCRIPT = r"""
import json, os, torch
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model

import kestrel.ops.kda as kda_ops
from kestrel.ops.kda import fla as fla_ops, triton_recurrent

# fla-core's chunked prefill kernels autotune, which Triton's interpreter cannot do: the prefill recurrence
# stays on the reference here, its conv runs the Triton inference kernel; the decode step runs the fla
# backend's default in-place recurrence (ours, KESTREL_KDA_DECODE=triton) and the Triton conv step.
hybrid = kda_ops.KDABackend(
    "fla", kda_ops.chunk_kda, kda_ops.recurrent_kda, triton_recurrent.recurrent_inplace,
    fla_ops.conv_step_inplace, kda_ops._short_conv_auto,
)
kda_ops._fla_backend = lambda: hybrid
model = build_model("tiny", seed=21)
prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 13, 23, 37)]
import kestrel.ops.mla.triton_prefill_expanded as expanded_ops
expanded_calls = []
real_expanded = expanded_ops.sparse_mla_prefill_expanded
expanded_ops.sparse_mla_prefill_expanded = lambda *a, **k: (expanded_calls.append(1), real_expanded(*a, **k))[1]
result = {}


def tokens(attn, kda, sparse):  # the prompts' greedy tokens, 4 each, with these backends
    os.environ["KESTREL_ATTN_BACKEND"], os.environ["KESTREL_KDA_BACKEND"] = attn, kda
    os.environ["KESTREL_SPARSE_PREFILL"] = sparse
    # 16-token chunks: the longer prompts prefill in chunks after their own first ones (q0 > 0)
    config = EngineConfig(model="tiny", page_size=4, enable_prefix_cache=False, chunked_prefill_size=16)
    engine = Engine(config, model=model)
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), str(i))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


configs = (
    ("torch", "torch", "naive", "rows"),
    ("triton", "triton", "naive", "auto"),  # the default: at tiny's sizes these chunks take the rows kernel
    ("fast", "triton", "fla", "rows"),
    ("expanded", "triton", "naive", "expanded"),
)
for name, attn, kda, sparse in configs:
    result[name] = tokens(attn, kda, sparse)
result["expanded_calls"] = len(expanded_calls)
# the rows GEMV with the conv step and the output gates inside it (KESTREL_GEMV_FUSE's paths, which apply only on
# a Hopper GPU: forced here where the rows kernel takes the rows), on the fast config
import kestrel.layers.kda as kda_layer, kestrel.layers.mla as mla_layer
from kestrel.ops import linear as linear_ops
fused_calls = []
for module in (kda_layer, mla_layer):
    module.fused_gemv_applies = lambda fusion, x, w, group=1: x.shape[0] <= 4
for name in ("linear_conv", "linear_gated"):
    real = getattr(linear_ops, name)
    spy = lambda *a, _real=real, _name=name, **k: (fused_calls.append(_name), _real(*a, **k))[1]
    for module in (kda_layer, mla_layer):
        if hasattr(module, name):
            setattr(module, name, spy)
result["fused"] = tokens("triton", "fla", "rows")
result["fused_calls"] = {name: fused_calls.count(name) for name in ("linear_conv", "linear_gated")}
print(json.dumps(result))
"""


def _start(script: str) -> early.Child:
    """The script in a fresh interpreter with TRITON_INTERPRET=1 (started when collection ends: tests/early.py)."""
    return early.spawn_interpreted([sys.executable, "-c", script])


def _result(key: str) -> dict:
    """The child's last stdout line, as JSON."""
    returncode, stdout, stderr = early.child(key).result(timeout=600)
    assert returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


early.register("triton_decode_path", lambda: _start(SCRIPT))


@pytest.mark.early("triton_decode_path")
def test_triton_decode_path_matches_torch_path():
    result = _result("triton_decode_path")
    assert result["triton"] == result["torch"]
    assert result["fast"] == result["torch"]
    assert result["expanded"] == result["torch"] and result["expanded_calls"] > 0
    assert all(len(v) == 4 for v in result["torch"].values())
    # the conv step and the output gates inside the rows GEMV: the same tokens; each ran in the decode steps
    assert result["fused"] == result["torch"]
    assert result["fused_calls"]["linear_conv"] > 0 and result["fused_calls"]["linear_gated"] > 0


DENSE_SCRIPT = r"""
import json, os, torch
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import init_random_weights
from kestrel.presets import preset_config

model = KimiForCausalLM(preset_config("tiny", "kimi_linear"), torch.float32)  # MLA without DSA: dense prefill
init_random_weights(model, seed=5)
base = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
prompts = [base, base + [7, 8, 9, 10, 11], base[:17]]  # the later ones hit the cached prefix
result = {}
for attn in ("torch", "triton"):
    os.environ["KESTREL_ATTN_BACKEND"] = attn
    engine = Engine(EngineConfig(model="tiny", page_size=4, chunked_prefill_size=8), model=model)
    out = {}
    for i, p in enumerate(prompts):  # one at a time, so that the prefix cache holds the earlier ones
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), str(i))
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    result[attn] = out
# fresh prompts arriving together, in one chunk: runs of one length attend in one call (three of 6 tokens, two
# of 9), the lone one of 5 alone
import kestrel.layers.mla as mla_layer
batched_calls = []
real_sdpa = mla_layer.mla_prefill_sdpa
mla_layer.mla_prefill_sdpa = lambda q, *a: (batched_calls.append(q.dim() == 4), real_sdpa(q, *a))[1]
g = torch.Generator().manual_seed(2)
fresh = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 6, 6, 9, 9, 5)]
for attn in ("torch", "triton"):
    os.environ["KESTREL_ATTN_BACKEND"] = attn
    engine = Engine(EngineConfig(model="tiny", page_size=4, chunked_prefill_size=64), model=model)
    out = {}
    for i, p in enumerate(fresh):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), str(i))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    result["fresh_" + attn] = out
result["batched_calls"] = sum(batched_calls)
result["single_calls"] = len(batched_calls) - sum(batched_calls)
result["mla_layers"] = len(model.config.mla_layer_ids)
print(json.dumps(result))
"""


early.register("dense_prefill_path", lambda: _start(DENSE_SCRIPT))


@pytest.mark.early("dense_prefill_path")
def test_dense_prefill_path_matches_torch_path():
    """MLA without DSA on the fast path: chunked prefill (8-token chunks, so most chunks follow a cached
    prefix) and prefix-cache hits through fused attention (mla_prefill_sdpa), decode through the paged kernel."""
    result = _result("dense_prefill_path")
    assert result["triton"] == result["torch"]
    # fresh prompts in one chunk: two runs (3 x 6 and 2 x 9 tokens) a MLA layer in one call each, the lone
    # prompt of 5 alone; the same tokens as the torch path
    assert result["fresh_triton"] == result["fresh_torch"]
    assert all(len(v) == 5 for v in result["fresh_torch"].values())
    layers = result["mla_layers"]
    assert layers >= 1 and result["batched_calls"] == 2 * layers and result["single_calls"] == layers, result
