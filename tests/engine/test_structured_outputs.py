"""Structured outputs through the engine: every output of a grammar is a prefix of a match, and a match when it
ends by EOS; other rows of the batch sample as they would alone; the overlap schedule and the plain one give
the same tokens; min_tokens cannot push past a complete output; bad specs are clear errors."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from kestrel.engine.engine import RequestError
from kestrel.engine.llm import LLM
from kestrel.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kestrel.grammar.regex import Automaton
from kestrel.presets import shipped_model_dir

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", 'b"c', "日本"]}, "maxItems": 3},
        "ok": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", max_model_len=256)


def _run(llm, spec: StructuredOutputsParams, prompts=("ab", "xyz"), **params) -> list:
    params = {"max_tokens": 48, "seed": 1, **params}
    outs = llm.generate(list(prompts), SamplingParams(structured_outputs=spec, **params), use_tqdm=False)
    return [c for o in outs for c in o.outputs]


@functools.cache
def _automaton(pattern: str) -> Automaton:
    return Automaton(pattern)


def _is_prefix(pattern: str, text: str) -> bool:
    """Some match starts with `text` (an output max_tokens cut); where an output ended by EOS, the test checks
    a whole match with Python's re as well."""
    a = _automaton(pattern)
    state = a.start
    for b in text.encode("utf-8"):
        state = a.next(state, b)
        if state == 0:
            return False
    return True


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(regex=r"(?:yes|no)!{1,3}"),
        StructuredOutputsParams(choice=["Paris", "London", "a|b"]),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-f]{2,5}"),
        StructuredOutputsParams(json=PERSON),
        StructuredOutputsParams(json_object=True),
    ],
    ids=["regex", "choice", "regex2", "schema", "json_object"],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_the_grammar(llm, spec, temperature):
    """The tiny model's weights are random: left alone its tokens are noise, so each one here is the grammar's."""
    outs = _run(llm, spec, n=2, temperature=temperature)
    for c in outs:
        assert _is_prefix(spec.pattern, c.text), c.text
        if c.finish_reason == "stop":
            assert re.fullmatch(spec.pattern, c.text), c.text
            if spec.json is not None:
                jsonschema.validate(json.loads(c.text), spec.json)
            if spec.json_object:
                assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 48
    assert any(c.finish_reason == "stop" for c in outs) or spec.json_object


def test_other_rows_sample_as_alone(llm):
    """A constrained request beside free ones: theirs are the tokens they get alone."""
    free = SamplingParams(max_tokens=12, temperature=0)
    alone = [o.outputs[0].token_ids for o in llm.generate(["ab", "cd"], free, use_tqdm=False)]
    constrained = SamplingParams(
        max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex="x+")
    )
    outs = llm.generate(["ab", "zz", "cd"], [free, constrained, free], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert set(outs[1].outputs[0].text) == {"x"}


def test_overlap_and_plain_schedules_agree():
    spec = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3, n=3, structured_outputs=spec)
    got = []
    for plain in (False, True):
        llm = LLM("tiny", device="cpu", max_model_len=256, disable_overlap_schedule=plain)
        got.append(
            [c.token_ids for o in llm.generate(["ab", "q"], params, use_tqdm=False) for c in o.outputs]
        )
    assert got[0] == got[1]


def test_grammar_rows_run_ahead_with_the_plain_schedules_tokens(monkeypatch):
    """Under the overlap schedule a grammar's batch launches its next forward before the step in flight lands,
    then samples with the landed token's mask (`Engine._land_then_sample`): the steps run ahead, and every
    sampling option beside the grammar (penalties, min_tokens, logprobs, a stop string, rows that stop early
    and rows without a grammar) gives the plain schedule's tokens."""
    from kestrel.engine.engine import Engine

    ahead = []
    land_then_sample = Engine._land_then_sample

    def spy(self, landing, nxt, logits):
        ahead.append(len(nxt.decode))
        return land_then_sample(self, landing, nxt, logits)

    monkeypatch.setattr(Engine, "_land_then_sample", spy)
    spec = StructuredOutputsParams(json=PERSON)
    params = [
        SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=2, structured_outputs=spec, min_tokens=6),
        SamplingParams(
            max_tokens=30,
            temperature=0,
            frequency_penalty=0.7,
            presence_penalty=0.3,
            logprobs=2,
            structured_outputs=spec,
        ),
        SamplingParams(max_tokens=24, temperature=0.7, seed=2, stop=[","], structured_outputs=spec),
        SamplingParams(max_tokens=20, temperature=0),
    ]
    got = {}
    for plain in (False, True):
        ahead.clear()
        llm = LLM("tiny", device="cpu", max_model_len=256, disable_overlap_schedule=plain)
        outs = llm.generate(["ab", "q", "xyz", "hello"], params, use_tqdm=False)
        got[plain] = [
            (c.token_ids, c.finish_reason, [sorted(lp) for lp in c.logprobs or []])
            for o in outs
            for c in o.outputs
        ]
        assert bool(ahead) is not plain  # the overlap schedule took the grammar's path; the plain one never
    assert got[False] == got[True]
    assert any(reason == "stop" for _, reason, _ in got[False])  # a row stopped while others went on


@pytest.mark.parametrize("plain", [False, True])
def test_a_stop_on_a_page_boundary_under_the_overlap(plain):
    """A grammar's row that stops (EOS after "ok") as its tokens fill a page: the next step's positions and
    checkpoint were taken after the landing had freed its slot (a crash, a checkpoint slot leaked). Both
    schedules: its tokens, and no checkpoint slot left held once the cache is flushed."""
    llm = LLM("tiny", device="cpu", max_model_len=256, disable_overlap_schedule=plain)
    params = SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=["ok"])
    )
    page = llm.engine.kv_pool.page_size
    for n in (page - 4, page - 3):  # the prompt, "o", "k" and EOS end on the boundary with page - 3
        (out,) = llm.generate([[7] * n], params, use_tqdm=False)
        assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"
    llm.engine.flush_cache()
    assert llm.engine.cache_stats()["num_checkpoints_used"] == 0


@pytest.mark.parametrize("plain", [False, True])
def test_a_pattern_too_ambiguous_mid_output_ends_its_request_only(plain):
    """A pattern whose automaton grows too ambiguous past its compile-time probe (the bias steers into it):
    that request ends (abort), the free row beside it runs to its length, on both schedules (under the overlap
    the finished row, still sampled once, had made its mask again outside any handler)."""
    llm = LLM("tiny", device="cpu", max_model_len=256, disable_overlap_schedule=plain)
    spec = StructuredOutputsParams(regex="a|(?:[c-z]{1,200}){1,200}")
    c = llm.engine.tokenizer.encode("c")[-1]
    params = [
        SamplingParams(max_tokens=200, temperature=0, logit_bias={c: 100.0}, structured_outputs=spec),
        SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    ]
    constrained, free = (o.outputs[0] for o in llm.generate(["ab", "cd"], params, use_tqdm=False))
    assert constrained.finish_reason == "abort" and len(constrained.token_ids) < 200
    assert free.finish_reason == "length" and len(free.token_ids) == 200


def test_a_grammar_checked_then_evicted_is_not_compiled_again(llm, monkeypatch):
    """The server compiles a request's grammar when it checks it, in a worker thread; the engine adds the request
    later, on its own thread. A grammar the cache let go in between (other patterns compiled) is the one the
    check compiled, not a second compile on the engine's thread."""
    from kestrel.grammar import tokens

    engine = llm.engine
    monkeypatch.setattr(engine.grammars, "_size", 1)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]{3}x"))
    checked = engine.grammar_of(params)
    other = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[cd]{3}y"))
    engine.grammar_of(other)  # evicts it
    compiled = []
    monkeypatch.setattr(tokens.Grammar, "__init__", lambda *a: compiled.append(a) or pytest.fail("compiled"))
    rid = engine.add_request([1, 2], params)
    assert engine.requests[rid].grammar is checked and not compiled
    engine.abort(rid)
    engine.step()


def test_a_pinned_grammar_neither_keeps_its_engine_nor_stops_copies():
    """The grammar an engine pins on a spec (above) holds the engine weakly (a client's params kept the whole
    engine, its weights and pools, alive), and copies and pickles of the params leave it out (they failed on the
    cache's lock)."""
    import copy
    import gc
    import pickle
    import weakref

    llm = LLM("tiny", device="cpu", max_model_len=256)
    params = SamplingParams(
        max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=["ok"])
    )
    assert llm.generate(["ab"], params, use_tqdm=False)[0].outputs[0].text == "ok"
    for again in (copy.deepcopy(params), pickle.loads(pickle.dumps(params))):
        assert again == params and "_compiled" not in again.structured_outputs.__dict__
        assert llm.generate(["ab"], again, use_tqdm=False)[0].outputs[0].text == "ok"
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None


def test_min_tokens_stops_at_a_complete_output(llm):
    """Past the grammar's end only EOS is allowed: min_tokens cannot ban it (the row would have no token)."""
    (c,) = _run(llm, StructuredOutputsParams(choice=["ok"]), prompts=["ab"], min_tokens=10, temperature=0)
    assert c.text == "ok" and c.finish_reason == "stop"


def test_bad_specs_are_clear_errors(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="regex: missing '\\)'"):
        StructuredOutputsParams(regex="(a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(RequestError, match="too large") as e:
        llm.generate(
            ["ab"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(?:a{1000}){500}"))
        )
    assert e.value.param == "structured_outputs"
    with pytest.raises(RequestError, match="too ambiguous") as e:
        llm.generate(
            ["ab"],
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="(?:[a-z]{1,200}){1,200}")),
        )
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        SamplingParams(allowed_token_ids=[1], structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="json_object must be true"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(ValueError, match="false"):
        StructuredOutputsParams(json=False)


def test_properties_come_in_the_schemas_order():
    """`reasoning` before `answer`, as written (a sorted copy of the schema had put `answer` first)."""
    schema = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
    }
    pattern = StructuredOutputsParams(json=schema).pattern
    assert re.fullmatch(pattern, '{"reasoning":"x","answer":1}')
    assert not re.fullmatch(pattern, '{"answer":1,"reasoning":"x"}')
    assert StructuredOutputsParams(json=json.dumps(schema)).pattern == pattern


def test_a_grammar_stopped_by_eos_before_min_tokens_ends_there(llm):
    """EOS, which the sampler allows before min_tokens only where the grammar is complete, ends the output
    (it had been taken as a token and the output padded with EOS up to min_tokens)."""
    (c,) = _run(llm, StructuredOutputsParams(regex="(?:y|n)"), prompts=["ab"], min_tokens=10, temperature=0)
    assert c.text in ("y", "n") and len(c.token_ids) == 2 and c.finish_reason == "stop"


@pytest.mark.skipif(shipped_model_dir() is None, reason="the shipped model is not in this install")
def test_shipped_model_fills_a_schema():
    llm = LLM(str(shipped_model_dir()), device="cpu")
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["cm", "m"]}},
        "required": ["answer", "unit"],
    }
    spec = StructuredOutputsParams(json=schema)
    (out,) = llm.chat(
        [{"role": "user", "content": "What is 12 + 30?"}],
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec),
        use_tqdm=False,
    )
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_graphs_both_schedules():
    """On the GPU (decode graphs, masks uploaded through pinned memory): outputs follow the grammar, beside free
    rows, and the overlap schedule gives the plain one's tokens."""
    spec = StructuredOutputsParams(json=PERSON)
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, n=3, structured_outputs=spec),
        SamplingParams(max_tokens=40, temperature=0),
    ]
    got = []
    for plain in (False, True):
        llm = LLM("tiny", device="cuda", max_model_len=256, disable_overlap_schedule=plain)
        outs = llm.generate(["ab", "q"], params, use_tqdm=False)
        for c in outs[0].outputs:
            assert _is_prefix(spec.pattern, c.text), c.text
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), PERSON)
        got.append([c.token_ids for o in outs for c in o.outputs])
    assert got[0] == got[1]


def test_a_thought_before_the_constraint():
    """`thought`: the output's reasoning is free up to its first </think>, and the constraint holds from there
    (whitespace between free); the thought's pattern is checked against Python's re on random texts, and the
    engine's grammar over the tiny model's vocabulary allows what the pattern does."""
    import random

    from kestrel.engine.sampling_params import THOUGHT_PATTERN

    rng, thought = random.Random(0), _automaton(THOUGHT_PATTERN)
    for _ in range(3000):
        text = "".join(rng.choice("</thinkx>é\n") for _ in range(rng.randint(0, 16)))
        text += "</think>" * (rng.random() < 0.4)
        first_close_at_end = text.endswith("</think>") and text.find("</think>") == len(text) - len(
            "</think>"
        )
        assert (re.fullmatch(THOUGHT_PATTERN, text) is not None) == first_close_at_end
        assert thought.matches(text) == first_close_at_end
    optional = StructuredOutputsParams(regex="^[0-9]+$", thought="optional")
    opened = StructuredOutputsParams(regex="[0-9]+", thought="opened")
    cases = {
        "42": (True, False),
        "<think>a </think> b</think>\n 7": (False, False),  # the first </think> ends the thought
        "<think>a <b> c</think>\n 7": (True, True),
        "  <think>z</think>1": (True, True),
        "z</think>1": (False, True),
        "<think>z</think>": (False, False),
    }
    for text, (want_optional, want_opened) in cases.items():
        assert _automaton(optional.pattern).matches(text) == want_optional, text
        assert _automaton(opened.pattern).matches(text) == want_opened, text
    # a body's own anchors dropped inside the larger pattern, an escaped `$` (after an escaped backslash too) kept
    for regex, text in (("^a$", "a"), (r"a\$", "a$"), ("a\\\\$", "a\\"), (r"a\\\$", "a\\$")):
        assert re.fullmatch(regex, text), regex
        assert _automaton(StructuredOutputsParams(regex=regex, thought="opened").pattern).matches(
            "hm</think>" + text
        )
    with pytest.raises(ValueError, match="thought is 'optional', 'opened' or None"):
        StructuredOutputsParams(regex="x", thought="maybe")


def test_a_thought_then_a_schema_in_the_engine(llm):
    """The engine's grammar: any token inside the thought, then the schema's; EOS only once the schema's output
    is whole. The tiny model's free thought, sampled, is cut by max_tokens, never forced to JSON."""
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}, thought="opened"
    )
    grammar = llm.engine.grammar_of(SamplingParams(structured_outputs=spec))
    tok, eos = llm.tokenizer, llm.engine.eos_token_ids[0]
    state = grammar.start
    for token in tok.encode("Hm, <b>?</think>\n"):
        assert grammar.allowed(state)[token]
        state = grammar.advance(state, token)
    assert not grammar.allowed(state)[tok.encode("x")[0]] and not grammar.allowed(state)[eos]
    for token in tok.encode('{"a":1}'):
        assert grammar.allowed(state)[token]
        state = grammar.advance(state, token)
    assert grammar.allowed(state)[eos]
    (out,) = _run(llm, spec, prompts=("ab",), max_tokens=24, temperature=1.0)
    assert out.finish_reason == "length" and not out.text.lstrip().startswith("{")
