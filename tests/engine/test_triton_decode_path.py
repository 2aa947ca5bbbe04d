"""The engine's decode through the Triton kernels (paged indexer scores, exact top-k, sparse MLA) gives the
same tokens as the torch path. On CPU the kernels run in Triton's interpreter, in a subprocess, because
TRITON_INTERPRET must be set before Triton is first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, os, torch
from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model

model = build_model("tiny", seed=21)
prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 37)]
result = {}
for backend in ("torch", "triton"):
    os.environ["KESTREL_ATTN_BACKEND"] = backend
    engine = Engine(EngineConfig(model="tiny", page_size=4, enable_prefix_cache=False), model=model)
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), str(i))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    result[backend] = out
print(json.dumps(result))
"""


def test_triton_decode_path_matches_torch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "KESTREL_KDA_BACKEND": "naive"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["triton"] == result["torch"]
    assert all(len(v) == 6 for v in result["torch"].values())
