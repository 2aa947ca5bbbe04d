"""`kestrel.serve.choice.ChoiceState`: each token's text offset where the text it was sent in holds back a tail that
might begin a stop string (the completions API's `logprobs.text_offset`)."""

import pytest

from kestrel.engine.outputs import StepOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.serve.choice import ChoiceState
from kestrel.serve.streams import native_finish_reason
from kestrel.tokenizer import ByteTokenizer


def _out(ids: list[int], finished: bool = False, reason: str = "length", stop=None) -> StepOutput:
    return StepOutput("r", ids, None, finished, reason if finished else None, stop, 1, 0)


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("prefix", ["", "echo: "])
def test_text_offsets_point_at_each_token_behind_held_back_text(per_step, prefix):
    tok = ByteTokenizer()
    text = "a the b thx é the c"  # "the" could begin the stop string, "é" is two tokens
    ids = tok.encode(text)
    choice = ChoiceState(tok, [0], SamplingParams(stop=["the *"], max_tokens=64), prefix=prefix)
    for i in range(0, len(ids), per_step):
        choice.update(_out(ids[i : i + per_step], finished=i + per_step >= len(ids)))
    assert choice.text == prefix + text and choice.finish_reason == "length"
    assert len(choice.text_offsets) == len(ids)
    # token i starts where the text of the ones before it ends; the second byte of "é" where the character does
    for i, offset in enumerate(choice.text_offsets):
        before = tok.decode(ids[:i]).rstrip("\ufffd")
        assert offset == len(prefix) + len(before), (i, choice.text_offsets)


@pytest.mark.parametrize(
    "data, offsets",
    [
        (b"\x86Fu", [0, 1, 2]),  # an invalid byte is a character (U+FFFD) of its own: "F" was at 0
        (b"a\xe2\x82\xacb", [0, 1, 1, 1, 2]),  # each byte of a character where the character starts
        (b"\xc3\xc3\xa9x", [0, 1, 1, 2]),  # a lead byte cut short by another: two characters
        (b"\xe2\x82F", [0, 0, 1]),  # a character cut short: one U+FFFD for both its bytes
        (b"\xf0\x9f\x98\x80\x86", [0, 0, 0, 0, 1]),
    ],
)
def test_text_offsets_around_invalid_utf8(data, offsets):
    """Each token's text_offset is where its text starts in the text returned, U+FFFD included."""
    tok = ByteTokenizer()
    choice = ChoiceState(tok, [0], SamplingParams(max_tokens=64))
    for i, byte in enumerate(data):
        choice.update(_out([byte], finished=i == len(data) - 1))
    assert choice.text == data.decode("utf-8", errors="replace")
    assert choice.text_offsets == offsets


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_and_stop_string_shown_only_when_asked_for(include):
    tok = ByteTokenizer()
    ids = tok.encode("x = 12;")
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include, max_tokens=64)
    choice = ChoiceState(tok, [0], params)
    choice.update(_out(ids[:3]))
    choice.update(_out(ids[3:], finished=True, reason="stop", stop=ids[-1]))
    assert choice.text == ("x = 12;" if include else "x = 12") and choice.token_ids == ids
    assert choice.text_offsets == list(range(len(ids)))
    # a stop string: cut before it, or after it with include
    params = SamplingParams(stop=["12", "zz"], include_stop_str_in_output=include, max_tokens=64)
    choice = ChoiceState(tok, [0], params)
    for i in range(len(ids)):
        choice.update(_out(ids[i : i + 1]))
    assert choice.finish_reason == "stop" and choice.text == ("x = 12" if include else "x = ")
    assert choice.stop_reason == "12"  # found here before the engine's output says so: still named


@pytest.mark.parametrize("per_step", [1, 2, 5])
def test_stop_strings_count_where_they_end_at_or_past_min_tokens(per_step):
    """A stop string ended by the tokens before the min_tokens-th is shown and passed over; one begun there and
    ended by the min_tokens-th token or later stops the choice (the engine's rule, and vLLM's)."""
    tok = ByteTokenizer()
    ids = tok.encode("ab;ab;ab;")

    def run(min_tokens: int) -> ChoiceState:
        choice = ChoiceState(tok, [0], SamplingParams(stop=["b;"], min_tokens=min_tokens, max_tokens=64))
        for i in range(0, len(ids), per_step):
            choice.update(_out(ids[i : i + per_step], finished=i + per_step >= len(ids)))
        return choice

    assert run(0).text == "a" and run(3).text == "a"  # "b;" ends with the third token
    straddling = run(5)  # the second "b;" begins with the fifth token, ends with the sixth
    assert straddling.text == "ab;a" and straddling.finish_reason == "stop"
    assert run(6).text == "ab;a"  # it ends with the sixth
    late = run(7)  # the second ended before the seventh: the third stops it
    assert late.text == "ab;ab;a" and late.stop_reason == "b;"
    never = run(10)
    assert never.text == "ab;ab;ab;" and never.finish_reason == "length"


def test_native_finish_reason_names_what_matched():
    """/generate's finish_reason as SGLang has it: EOS names its token id (stop_reason, the OpenAI routes', stays
    null for EOS, as in vLLM), a stop token its id, the length its count."""
    tok = ByteTokenizer()
    ids = [*tok.encode("ab"), tok.eos_token_ids[0]]
    for reason, stop, want in (
        ("stop", None, {"type": "stop", "matched": tok.eos_token_ids[0]}),
        ("stop", 98, {"type": "stop", "matched": 98}),
        ("length", None, {"type": "length", "length": 3}),
    ):
        choice = ChoiceState(tok, [0], SamplingParams(max_tokens=64))
        choice.update(_out(ids, finished=True, reason=reason, stop=stop))
        assert choice.stop_reason == stop and native_finish_reason(choice) == want
