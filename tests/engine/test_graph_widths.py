"""Decode graphs of two page-table widths: on an engine whose context limit is long, steps whose contexts all fit
a short width take graphs that wide (`kestrel.engine.runner.graph_widths`), and compute what the whole width
computes. On the CPU the staged inputs and the step's logits are compared (no graphs there); on CUDA the
engine's tokens with its graphs of both widths against its eager steps."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.runner import graph_widths
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import build_model
from kestrel.utils.errors import ConfigError
from tests.engine.test_engine import _prompt

SEED = 7


def test_graph_widths():
    # page size 64: 8192 tokens are 128 pages; a limit of 131072 tokens, 2048 pages
    assert graph_widths(2048, 64, 8192, 2048) == (128, 2048)
    assert graph_widths(2048, 64, 8192, None) == (128, 2048)  # no DSA layer (or dense attention)
    assert graph_widths(256, 64, 8192, None) == (128, 256)  # the limit twice the short width
    assert graph_widths(255, 64, 8192, None) == (255,)  # less: one width
    assert graph_widths(2048, 64, 0, None) == (2048,)  # off
    assert graph_widths(2048, 64, 8192, 8192) == (2048,)  # the top-k would take every short position
    assert graph_widths(2048, 64, 8000, 2048) == (125, 2048)  # rounded up to whole pages


def test_config_rejects_a_negative_short_width():
    with pytest.raises(ConfigError, match="cuda_graph_short_len"):
        EngineConfig(cuda_graph_short_len=-1)


def test_short_width_stages_and_computes_what_the_whole_width_does(monkeypatch):
    """The tiny model (DSA top-8), a 256-token limit, 16-token short graphs: while every context fits 16 tokens
    the step takes the short width, past it the whole; at the short width the staged page table is the whole
    one's first columns, the lengths and write rows are the same, and so are the step's logits (to float rounding:
    this CPU path gathers each row's history as wide as the table and reduces over it) and their argmax."""
    model = build_model("tiny", seed=SEED)
    engine = Engine(
        EngineConfig(
            model="tiny", page_size=4, max_running_requests=3, max_model_len=256, cuda_graph_short_len=16
        ),
        model=model,
    )
    runner, size = engine.runner, 4
    runner.graph_sizes = (size,)  # one padded bucket for the three requests
    runner.widths = graph_widths(runner.max_pages, 4, 16, 8)
    assert runner.widths == (4, 64)
    runner._static_inputs()  # what capture_graphs sets up on CUDA, here on the CPU
    pools = [t for d in (engine.state_pool.ssm, engine.state_pool.conv) for t in d.values()]
    seen = {"short": 0, "whole": 0}
    eager = runner._decode

    def decode(reqs, ids=None):
        width, bs = runner.graph_key(reqs)
        assert bs == size
        need = max(r.num_computed for r in reqs) + 1  # tokens the step reads, its own included
        assert width == (4 if need <= 16 else 64)
        runner._stage(reqs, ids)
        whole = runner._graph_inputs(runner.max_pages, size)
        short = runner._graph_inputs(width, size)
        runner._page_inputs(*whole)
        want = [t.clone() for t in whole]
        runner._page_inputs(*short)
        for k in (0, 1, 2, 4, 5):  # ids, positions, slots, lengths, write rows
            assert torch.equal(short[k], want[k])
        assert torch.equal(short[3], want[3][:, :width])
        if width < runner.max_pages:
            saved = [t.clone() for t in pools]
            got = runner._decode_forward(*short)[: len(reqs)]
            for t, s in zip(pools, saved):  # the step advanced the KDA states in place: back to before it
                t.copy_(s)
            full = runner._decode_forward(*want)[: len(reqs)]
            for t, s in zip(pools, saved):
                t.copy_(s)
            torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
            assert torch.equal(got.argmax(-1), full.argmax(-1))
        seen["short" if width < runner.max_pages else "whole"] += 1
        return eager(reqs, ids)

    monkeypatch.setattr(runner, "_decode", decode)
    for i, n in enumerate((3, 7, 9)):
        engine.add_request(_prompt(n, i), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seen["short"] >= 3 and seen["whole"] >= 3, seen


def _recorded(graph_key, keys: list):
    """graph_key, appending each key it gives to `keys`."""

    def wrapped(reqs):
        keys.append(graph_key(reqs))
        return keys[-1]

    return wrapped


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("short_len", [0, 16])
def test_graphs_of_both_widths_give_the_eager_tokens(short_len):
    """On CUDA: greedy requests whose contexts grow past the short width, with the decode graphs (short and whole
    width, or the whole only) against eager steps: the same tokens; with short graphs, both widths replayed."""
    model = build_model("tiny", dtype=torch.float32, device="cuda", seed=SEED)
    # (prompt, tokens): the 30-token prompt decodes past the short width for its 3 tokens; then the others decode
    # inside it until their contexts pass 16 tokens
    jobs = [(_prompt(n, i), m) for i, (n, m) in enumerate(((3, 14), (7, 14), (9, 14), (30, 3)))]
    out = {}
    for graphs in (True, False):
        engine = Engine(
            EngineConfig(
                model="tiny",
                device="cuda",
                page_size=4,
                max_running_requests=4,
                max_model_len=256,
                kv_cache_bytes=64 * 2**20,
                cuda_graph_short_len=short_len,
                disable_cuda_graph=not graphs,
            ),
            model=model,
        )
        keys = []
        if graphs:
            assert engine.runner.widths == ((4, 64) if short_len else (64,))
            assert engine.runner.graph_bytes > 0  # the capture's inputs and outputs, kept reserved
            engine.runner.graph_key = _recorded(engine.runner.graph_key, keys)
        tokens = {}
        for i, (ids, m) in enumerate(jobs):
            engine.add_request(ids, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), str(i))
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        out[graphs] = tokens
        if graphs:
            assert {w for w, _ in keys} == set(engine.runner.widths), keys
    assert out[True] == out[False]
