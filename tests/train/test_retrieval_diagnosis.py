"""scripts/retrieval_diagnosis.py's classes of a wrong lookup (what its JSON reports)."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def classify():
    return load_script("retrieval_diagnosis").classify


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


def test_name_swap_counts_whether_the_name_steers_the_copy(monkeypatch):
    """name_swap with a stand-in model: one that writes each named person's next digit reads the name (both
    names right, never the same digit); one that always writes the same digit ignores it."""
    import re
    from types import SimpleNamespace

    module = load_script("retrieval_diagnosis", "retrieval_diagnosis_swap")
    codes = {"Ada Low": "12345", "Bo Ek": "19999", "Cy Fen": "55555"}  # Bo shares "1", Cy shares nothing
    prompt = (
        " ".join(f"The code of {n} is {c}." for n, c in codes.items())
        + " Question: What is the code of Ada Low?"
    )
    ex = SimpleNamespace(prompt=prompt, answer="12345", meta={"name": "Ada Low"})
    tok = SimpleNamespace(encode=lambda text: [text])
    monkeypatch.setattr(module, "prompt_ids", lambda tok, ex: [])

    def reads_the_name(llm, prompts, max_tokens):
        out = []
        for (text,) in prompts:
            name, done = re.match(r"The text says: The code of (.*) is ?(\d*)$", text).groups()
            out.append(" " + codes[name][len(done) :])
        return out

    monkeypatch.setattr(module, "_greedy", reads_the_name)
    got = module.name_swap(None, tok, [ex])
    assert got == {
        "shared_0": {"pairs": 1, "asked_name_right": 1, "distractor_name_right": 1, "same_digit": 0},
        "shared_1+": {"pairs": 1, "asked_name_right": 1, "distractor_name_right": 1, "same_digit": 0},
    }
    monkeypatch.setattr(module, "_greedy", lambda llm, prompts, max_tokens: [" 1"] * len(prompts))
    got = module.name_swap(None, tok, [ex])
    assert got["shared_0"] == {"pairs": 1, "asked_name_right": 1, "distractor_name_right": 0, "same_digit": 1}
    assert got["shared_1+"] == {
        "pairs": 1,
        "asked_name_right": 0,
        "distractor_name_right": 0,
        "same_digit": 1,
    }
