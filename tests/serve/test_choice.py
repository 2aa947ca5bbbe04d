"""`kestrel.serve.choice.ChoiceState`: each token's text offset where the text it was sent in holds back a tail that
might begin a stop string (the completions API's `logprobs.text_offset`)."""

import pytest

from kestrel.engine.outputs import StepOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.serve.choice import ChoiceState
from kestrel.tokenizer import ByteTokenizer


def _out(ids: list[int], finished: bool = False) -> StepOutput:
    return StepOutput("r", ids, None, finished, "length" if finished else None, None, 1, 0)


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
