"""Streaming detokenization (byte, HF, trained-BPE and non-concatenative tokenizers) and stop strings."""

import pytest

from kestrel.detokenize import IncrementalDetokenizer, StopStringMatcher
from kestrel.tokenizer import ByteTokenizer, HFTokenizer, save_byte_tokenizer
from tests.test_tokenizer import TEXTS


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("byte_tok"))
    save_byte_tokenizer(directory)
    return HFTokenizer(directory)


def _stream(tok, ids, chunk=1, prompt_ids=None, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces, detok.flush()


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_bytes(text, chunk, hf_tok):
    for tok in (ByteTokenizer(), hf_tok):
        ids = tok.encode(text)
        for skip in (True, False):
            prompt_ids = tok.encode("prompt ")
            pieces, rest = _stream(tok, ids, chunk, prompt_ids=prompt_ids, skip_special_tokens=skip)
            assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_emoji_split_across_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("a😀b")  # the emoji is four byte tokens
    pieces, rest = _stream(tok, ids)
    assert pieces == ["a", "", "", "", "😀", "b"] and rest == ""


def test_incremental_detokenizer_invalid_tail_is_flushed():
    tok = ByteTokenizer()
    pieces, rest = _stream(tok, [104, 105, 0xF0, 0x9F])
    assert pieces == ["h", "i", "", ""] and rest == "\ufffd"


def test_incremental_detokenizer_trained_bpe():
    """Merged byte-level tokens that end mid-character, as in real BPE vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3, trainer)
    text = "中文 and 😀👍🏽 with wörld"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode("utf-8"))  # merges happened
    pieces = []
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("hello ").ids)
    for i in ids:
        pieces.append(detok.add([i]))
    assert "".join(pieces) + detok.flush() == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_non_concatenative_decode():
    """A Metaspace decoder drops a sequence's leading space: decode(a + b) != decode(a) + decode(b)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([1]) + tok.decode([2]) != tok.decode([1, 2])
    pieces, rest = _stream(tok, [1, 2, 3])
    assert pieces == ["Hello", " world", "!"] and rest == ""


def _stop_reference(chunks, stops):
    """What streaming must emit: stop at the first chunk whose cumulative text holds a stop string."""
    text = ""
    for chunk in chunks:
        text += chunk
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def _stop_stream(chunks, stops):
    matcher = StopStringMatcher(stops)
    out, stopped = "", False
    for chunk in chunks:
        emitted, stopped = matcher.feed(chunk)
        out += emitted
        if stopped:
            break
    return out + matcher.flush(), stopped


@pytest.mark.parametrize(
    "chunks, stops, expected",
    [
        (["Hello wor", "ld, STO", "P here"], ["STOP"], "Hello world, "),  # split across feeds
        (["abc", "</s", ">tail"], ["</s>", "\n\n"], "abc"),  # multiple stop strings
        (["one\n", "\ntwo</s>"], ["</s>", "\n\n"], "one"),  # the earliest one wins
        (["no stop ", "at all", " <"], ["</s>"], "no stop at all <"),  # held tail flushed at the end
        (["STOP", "after"], ["STOP"], ""),  # stop at the very start
        (["S", "T", "O", "P"], ["STOP"], ""),
        (["aaab"], ["aab"], "a"),
        (["x", "y"], [], "xy"),
    ],
)
def test_stop_string_matcher(chunks, stops, expected):
    assert _stop_stream(chunks, stops)[0] == expected
    assert _stop_stream(chunks, stops) == _stop_reference(chunks, stops)


def test_stop_string_matcher_withholds_only_possible_starts():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("text </e") == ("text ", False)
    assert matcher.feed("x") == ("</ex", False)
    assert matcher.feed("</end>more") == ("", True)
    assert matcher.feed("ignored") == ("", True)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])


def test_stop_string_matcher_counts_only_what_ends_past_armed_from():
    """min_tokens: a stop string ended in the text before `armed_from` does not count; one begun there and ended
    after does, its start taken from the tail held back."""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a STOP b ST", armed_from=11) == ("a STOP b ", False)  # all early; "ST" held
    assert matcher.feed("OP c", armed_from=0) == ("", True) and matcher.matched == "STOP"
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a STOP b STOP", armed_from=10) == ("a STOP b ", True)  # the second ends past 10
    # a shorter stop string whole inside the held tail was early; the longer one it begins is not
    matcher = StopStringMatcher(["b", "abc"])
    assert matcher.feed("xab", armed_from=3) == ("x", False)
    assert matcher.feed("z") == ("abz", False)
    matcher = StopStringMatcher(["b", "abc"])
    matcher.feed("xab", armed_from=3)
    assert matcher.feed("c") == ("", True) and matcher.matched == "abc"


def test_stop_string_matcher_random_splits():
    import random

    rng = random.Random(0)
    text = "the quick brown fox <|x|> jumps over\n\nthe lazy dog </s> end"
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stops = rng.sample(["</s>", "\n\n", "lazy", "<|x|>", "zzz", "o"], rng.randint(1, 3))
        assert _stop_stream(chunks, stops) == _stop_reference(chunks, stops)
