"""scripts/served_tokens.py: the shipped model served greedily on the CPU gives the tokens it gave on the H200
(session 39, the fast paths: decode graphs, one-launch MoE, Triton GEMVs), and a run that differs fails."""

from __future__ import annotations

import json

import pytest

from kestrel.presets import shipped_model_dir
from tests.scripts import load_script

served = load_script("served_tokens")
pytestmark = pytest.mark.skipif(shipped_model_dir() is None, reason="the trained demo model is not shipped")


def test_first_difference():
    assert served.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert served.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert served.first_difference([1, 2], [1, 2, 3]) == 2


def test_cpu_gives_the_h200_tokens(tmp_path):
    out = tmp_path / "served.json"
    assert served.main(["--device", "cpu", "--cuda-graph-short-len", "64", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same"] == result["prompts"] == 8
    assert result["graph_widths"] == []  # no CUDA graphs on the CPU (on CUDA: 64 and the limit's width)


def test_a_different_token_fails(tmp_path):
    reference = json.loads(served.REFERENCE.read_text())
    reference["outputs"] = reference["outputs"][:2]
    reference["outputs"][1]["tokens"][3] += 1  # one token off in the second prompt
    path = tmp_path / "reference.json"
    path.write_text(json.dumps(reference))
    out = tmp_path / "served.json"
    assert served.main(["--device", "cpu", "--reference", str(path), "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert [o["differs_at"] for o in result["outputs"]] == [None, 3]
