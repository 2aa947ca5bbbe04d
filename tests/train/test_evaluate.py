"""`kestrel eval`: scoring through the verifiers, the retrieval lengths, and the DSA/dense contrast."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.outputs import StepOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.layers.mla import MLAttention
from kestrel.tokenizer import ByteTokenizer
from kestrel.train.chat_format import assistant_text, prompt_ids
from kestrel.train.data import heldout_examples
from kestrel.train.evaluate import EvalConfig, _accuracy, evaluate, format_table


class ScriptedEngine:
    """Answers each prompt with a scripted text in one step: the engine surface `_accuracy` uses."""

    def __init__(self, replies: dict[tuple[int, ...], str], max_model_len: int = 4096):
        self.tokenizer = ByteTokenizer()
        self.plan = SimpleNamespace(max_model_len=max_model_len)
        self.scheduler = SimpleNamespace(waiting=[])
        self.replies, self.queue = replies, []

    def add_request(self, ids, params, rid):
        self.queue.append((rid, tuple(ids)))

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        done, self.queue = self.queue, []
        return [
            StepOutput(rid, self.tokenizer.encode(self.replies[ids]), None, True, "stop", None, len(ids), 1)
            for rid, ids in done
        ]


@pytest.mark.parametrize("family", ["chain_sum", "basic_arithmetic"])
def test_accuracy_is_what_the_verifier_says(family):
    tok = ByteTokenizer()
    examples = heldout_examples(family, 4)
    # right answers for the first two, a wrong one for the third, no answer line for the fourth
    texts = [assistant_text(ex) for ex in examples[:2]]
    texts += [f"{examples[2].reasoning}\nAnswer: {examples[2].answer}1", "I do not know"]
    engine = ScriptedEngine({tuple(prompt_ids(tok, ex)): t for ex, t in zip(examples, texts)})
    result = _accuracy(engine, examples, 64, family)
    assert result["n"] == 4 and result["accuracy"] == pytest.approx(0.5)
    # the two wrong answers, beside what was expected
    assert result["wrong_samples"] == [
        {"expected": ex.answer, "got": t} for ex, t in zip(examples[2:], texts[2:])
    ]


def test_prompt_past_the_context_scores_wrong_without_running():
    tok = ByteTokenizer()
    examples = heldout_examples("chain_sum", 2)
    short = min(len(prompt_ids(tok, ex)) for ex in examples)
    engine = ScriptedEngine({}, max_model_len=short)  # no room for a single new token
    assert _accuracy(engine, examples, 64, "chain_sum")["accuracy"] == 0.0


def test_evaluate_reports_every_family_and_length_with_the_dense_contrast():
    cfg = EvalConfig(
        model="tiny",
        num_per_family=2,
        num_retrieval=2,
        # 5000: past tiny's 4096 positions, skipped (the engine's limit asked for is the model's, not past it)
        retrieval_lengths=(300, 5000),
        families=("chain_sum", "countdown"),
        max_new_tokens=8,
        device="cpu",
    )
    seen: list = []
    result = evaluate(cfg, on_progress=lambda r: seen.append(json.dumps(r, sort_keys=True)))
    # the partial result after each family, each mode of each length and each skipped length, the last one the
    # whole table
    assert len(seen) == 5 and json.loads(seen[0])["families"].keys() == {"chain_sum"}
    assert seen[-1] == json.dumps(result, sort_keys=True)
    assert set(result["families"]) == {"chain_sum", "countdown"}
    assert set(result["retrieval"][300]) == {"dsa", "dense"}
    assert result["retrieval"][5000] == {"skipped": "context limit 4096"}
    for r in [*result["families"].values(), *result["retrieval"][300].values()]:
        assert r["n"] == 2 and 0.0 <= r["accuracy"] <= 1.0
    table = format_table(result)
    assert "| retrieval @300 (dense) | 2 |" in table and "| countdown | 2 |" in table


def test_wilson_interval():
    """Against hand-computed Wilson intervals: 37 of 50 (74%) spans 60.4-84.1%; all right or all wrong stay
    inside [0, 1] and are not a point; n = 0 says nothing."""
    from kestrel.train.evaluate import wilson_interval

    lo, hi = wilson_interval(37, 50)
    assert abs(lo - 0.6045) < 1e-3 and abs(hi - 0.8413) < 1e-3
    lo, hi = wilson_interval(50, 50)
    assert hi == 1.0 and 0.92 < lo < 0.93
    assert wilson_interval(0, 50)[0] == 0.0 and 0.07 < wilson_interval(0, 50)[1] < 0.08
    assert wilson_interval(0, 0) == (0.0, 1.0)
    table = format_table({"families": {"countdown": {"n": 50, "accuracy": 0.74}}, "retrieval": {}})
    assert "| countdown | 50 | 74.0% | 60%-84% |" in table


def test_dense_switch_flushes_the_prefix_cache_and_restores_top_k():
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4))
    indexers = [m.indexer for m in engine.model.modules() if isinstance(m, MLAttention) and m.indexer]
    topk = [ix.topk for ix in indexers]
    engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4), "a")
    while engine.has_unfinished():
        engine.step()
    assert engine.cache_stats()["num_cached_pages"] > 0
    engine.set_dense_attention(True)
    assert engine.cache_stats()["num_cached_pages"] == 0
    assert all(ix.topk is None for ix in indexers)
    engine.set_dense_attention(False)
    assert [ix.topk for ix in indexers] == topk
