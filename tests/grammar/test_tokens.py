"""A grammar's token masks against a brute-force walk of each token's bytes, on the shipped model's BPE vocabulary,
the byte tokenizer and a synthetic one; EOS only where the output is a match; generation by the masks alone
yields matches."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from kestrel.grammar.regex import Automaton
from kestrel.grammar.tokens import Grammar, GrammarCache, Vocabulary
from kestrel.presets import shipped_model_dir
from kestrel.tokenizer import ByteTokenizer, load_tokenizer

PATTERNS = [
    r'\{"name":"[a-z ]{1,12}","age":(?:0|[1-9]\d{0,2})\}',
    r"(?:yes|no|maybe)",
    r"[0-9]{3}-[0-9]{4}",
    r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"',
    r"(?:é|日本)+!",
]


def _synthetic() -> Vocabulary:
    """The 256 bytes and 3,000 seeded strings of 2-9 bytes (a deep trie whose walks go both ways: most of a
    level alive inside a string, a few below a schema's literal) and some ids the same bytes as others."""
    rng = random.Random(1)
    alphabet = 'abcxyz019 {}:,"-é'
    tokens = [bytes([i]) for i in range(256)]
    tokens += ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9))).encode() for _ in range(3000)]
    tokens += [tokens[300], tokens[301], b""]  # twins of two tokens; EOS
    return Vocabulary(tokens + [b""] * 7, eos_ids=(len(tokens) - 1,))  # 7 ids past the tokens, as models pad


@pytest.fixture(scope="module", params=["demo", "bytes", "synthetic"])
def vocab(request):
    if request.param == "synthetic":
        return _synthetic()
    if request.param == "demo" and shipped_model_dir() is None:
        pytest.skip("the shipped model is not in this install")
    tok = load_tokenizer(str(shipped_model_dir())) if request.param == "demo" else ByteTokenizer()
    return Vocabulary.of(
        tok, tok.vocab_size + 7, tok.eos_token_ids
    )  # 7 ids past the tokenizer's, as models pad


def _brute(automaton: Automaton, state: int, vocab: Vocabulary) -> np.ndarray:
    ok = np.zeros(vocab.size, dtype=bool)
    for i, data in enumerate(vocab.token_bytes):
        s = state
        for b in data:
            s = automaton.next(s, b)
        ok[i] = bool(data) and s != 0
    if automaton.accepting(state) or not ok.any():
        ok[list(vocab.eos_ids)] = True
    return ok


@pytest.mark.parametrize("pattern", PATTERNS)
def test_masks_equal_the_brute_force_walk(pattern, vocab):
    """Along random walks of allowed tokens: each visited state's mask is the brute force's."""
    grammar = Grammar(pattern, vocab)
    reference = Automaton(pattern)  # walked byte by byte, apart from the grammar's own
    rng = random.Random(0)
    for _walk in range(4):
        state, ref_state, text = grammar.start, reference.start, b""
        for _ in range(30):
            mask = grammar.allowed(state)
            assert np.array_equal(mask, _brute(reference, ref_state, vocab)), (pattern, text)
            ids = np.flatnonzero(mask).tolist()
            token = rng.choice(ids)
            if token in vocab.eos_ids:
                assert re.fullmatch(pattern, text.decode("utf-8")), text
                break
            text += vocab.token_bytes[token]
            state = grammar.advance(state, token)
            for b in vocab.token_bytes[token]:
                ref_state = reference.next(ref_state, b)
            assert state != 0


def test_special_and_padding_ids_are_never_allowed(vocab):
    grammar = Grammar(r"[\x00-\x7f]*", vocab)  # any ASCII: every byte token goes
    mask = grammar.allowed(grammar.start)
    assert not mask[vocab.size - 7 :].any()  # past the tokenizer
    empty = [i for i, b in enumerate(vocab.token_bytes) if not b and i not in vocab.eos_ids]
    assert empty and not mask[empty].any()
    assert mask[list(vocab.eos_ids)].all()  # the empty output is a match


def test_complete_state_allows_eos_alone(vocab):
    grammar = Grammar("ok", vocab)
    state = grammar.start
    for b in b"ok":
        state = grammar.automaton.next(state, b)
    assert grammar.is_complete(state)
    assert set(np.flatnonzero(grammar.allowed(state)).tolist()) == set(vocab.eos_ids)
    assert not grammar.is_complete(grammar.start)


def test_a_dead_end_allows_eos_so_the_output_ends():
    """A pattern needing bytes no token writes: EOS rather than nothing (the sampler would pick garbage)."""
    vocab = Vocabulary([b"a", b"b", b""], eos_ids=(2,))
    grammar = Grammar("ac", vocab)
    state = grammar.advance(grammar.start, 0)
    assert grammar.allowed(state).tolist() == [False, False, True]


def test_a_grammar_too_ambiguous_is_refused_at_compile():
    """The probe walks the pattern on its compile: the error comes before any token, not in the middle."""
    from kestrel.grammar.regex import PatternError

    with pytest.raises(PatternError, match="too ambiguous"):
        Grammar("(?:[a-z]{1,100}){1,100}", Vocabulary([b"a", b""], eos_ids=(1,)))


def test_cache_compiles_once_and_builds_the_vocabulary_lazily():
    made = []

    def vocabulary():
        made.append(1)
        return Vocabulary([b"a", b""], eos_ids=(1,))

    cache = GrammarCache(vocabulary, size=2)
    assert not made
    g = cache.get("a+")
    assert cache.get("a+") is g and len(made) == 1
    cache.get("b"), cache.get("c")
    assert cache.get("a+") is not g  # evicted, compiled again


def test_a_thinking_models_special_think_markers_write_their_text(tmp_path):
    """Where `<think>` and `</think>` are special tokens, a grammar still allows them (a constraint's thought ends
    with the model's own `</think>`); the other special tokens stay out."""
    import json

    from kestrel.engine.sampling_params import StructuredOutputsParams
    from kestrel.tokenizer import HFTokenizer, save_byte_tokenizer

    save_byte_tokenizer(str(tmp_path))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    added = {"261": {"content": "<think>", "special": True}, "262": {"content": "</think>", "special": True}}
    config.setdefault("added_tokens_decoder", {}).update(added)
    config_path.write_text(json.dumps(config))
    tok = HFTokenizer(str(tmp_path))
    assert tok.encode("</think>") == [262] and 262 in tok.special_token_ids()
    vocab = Vocabulary.of(tok, tok.vocab_size, tok.eos_token_ids)
    assert vocab.token_bytes[261] == b"<think>" and vocab.token_bytes[262] == b"</think>"
    assert all(vocab.token_bytes[i] == b"" for i in tok.special_token_ids() if i not in (261, 262))
    grammar = Grammar(StructuredOutputsParams(regex="yes|no", thought="opened").pattern, vocab)
    state = grammar.start
    for token in tok.encode("hmm"):
        state = grammar.advance(state, token)
    assert grammar.allowed(state)[262]
    state = grammar.advance(state, 262)
    assert grammar.allowed(state)[ord("y")] and not grammar.allowed(state)[262]
