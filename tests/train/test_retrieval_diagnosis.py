"""scripts/retrieval_diagnosis.py's classes of a wrong lookup (what its JSON reports)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "retrieval_diagnosis.py"


@pytest.fixture(scope="module")
def classify():
    spec = importlib.util.spec_from_file_location("retrieval_diagnosis", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.classify


@pytest.mark.parametrize(
    "wrote, answer, others, kind",
    [
        ("90445.", "90445", ["99572"], "right"),
        ("99572.", "90445", ["99572"], "distractor"),  # another person's whole code
        ("12347.", "12345", ["98347"], "splice"),  # 1234 right, then 98347's digit after its 4
        ("22053.", "22086", ["22053"], "distractor"),
        ("65027.", "65020", ["50777"], "other"),
        ("904451", "90445", [], "other"),  # one reading of the written digits: six are not the code
        ("no code", "90445", ["99572"], "other"),
    ],
)
def test_wrong_lookups_are_classed(classify, wrote, answer, others, kind):
    assert classify(wrote, answer, others) == kind
