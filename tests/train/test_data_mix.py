"""scripts/data_mix.py: what a training batch holds for a data recipe (documents, token shares by family)."""

from __future__ import annotations

import pytest

from kestrel.presets import shipped_model_dir
from kestrel.tokenizer import load_tokenizer
from tests.scripts import load_script


def _load():
    return load_script("data_mix")


def test_recipes_parse_and_bad_ones_are_refused():
    mix = _load()
    assert mix.parse_recipe("short=256,512@2") == ("short", (256, 512), 2.0)
    for bad in ("short", "short=256", "=256@1", "x=256@0", "x=0@1", "x=a@1"):
        with pytest.raises(SystemExit, match="--recipe"):
            mix.parse_recipe(bad)


def test_shorter_retrieval_documents_fit_more_lookups_in_a_batch():
    """The shares add up, and the same token budget holds more retrieval problems of 256 tokens than of 1500."""
    mix = _load()
    tok = load_tokenizer(str(shipped_model_dir()))
    short = mix.batch_mix((256,), 1.0, 1, tok, rows=2, row_len=2048)
    long = mix.batch_mix((1500,), 1.0, 1, tok, rows=2, row_len=2048)
    for result in (short, long):
        assert sum(result["token_share"].values()) <= 1.0
        assert sum(result["loss_token_share"].values()) == pytest.approx(1.0, abs=0.01)
    assert short["documents_per_batch"]["retrieval"] > 2 * long["documents_per_batch"]["retrieval"] > 0


def test_batch_rate_times_the_batches():
    mix = _load()
    tok = load_tokenizer(str(shipped_model_dir()))
    rate = mix.batch_rate(mix.recipe_batches((256,), 1.0, tok, rows=1, row_len=2048), seconds=0.2)
    assert rate["batches"] >= 1 and rate["tokens_per_s"] == pytest.approx(
        rate["batches"] * 2048 / rate["seconds"], rel=0.02
    )
