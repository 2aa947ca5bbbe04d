"""An `Example` as a chat conversation in token ids, with the loss mask SFT trains on.

The prompt is exactly what the engine feeds at eval time (`apply_chat_template(..., add_generation_prompt=True)`
encoded without special tokens); the assistant turn is the worked steps, a final `Answer: <answer>` line and the
end-of-turn token. The loss mask is 1 on the assistant turn, end-of-turn token included, and on the tokens of the
prompt's `trained_prompt_tail` (the retrieval question) where the example has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.tokenizer import Tokenizer
from kestrel.train.family import Example

END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    loss_mask: list[int]  # 1 where the token is part of the assistant turn or of the prompt's trained tail
    num_prompt_tokens: int


def messages(example: Example, system: str | None = None) -> list[dict]:
    """The conversation up to the user turn."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": example.prompt}]


def assistant_text(example: Example) -> str:
    answer_line = f"Answer: {example.answer}"
    return f"{example.reasoning}\n{answer_line}" if example.reasoning else answer_line


def end_of_turn_id(tokenizer: Tokenizer) -> int:
    ids = tokenizer.encode(END_OF_TURN)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer has no single {END_OF_TURN} token (it encodes to {ids})")
    return ids[0]


def prompt_ids(tokenizer: Tokenizer, example: Example, system: str | None = None) -> list[int]:
    """The eval-time prompt: the chat template with the assistant header, ready for generation."""
    text = tokenizer.apply_chat_template(messages(example, system), add_generation_prompt=True)
    return tokenizer.encode(text)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _tail_span(
    tokenizer: Tokenizer, example: Example, system: str | None, prompt: list[int]
) -> tuple[int, int]:
    """The prompt tokens that spell `example.trained_prompt_tail`: from where the prompt stops agreeing with the
    encoding of the text before the tail (a token straddling that boundary counts as the tail's) up to where it
    stops agreeing with the encoding of the text through the tail."""
    text = tokenizer.apply_chat_template(messages(example, system), add_generation_prompt=True)
    cut = text.rindex(example.trained_prompt_tail)
    start = _common_prefix(tokenizer.encode(text[:cut]), prompt)
    end = _common_prefix(tokenizer.encode(text[: cut + len(example.trained_prompt_tail)]), prompt)
    return start, max(start, end)


def render(tokenizer: Tokenizer, example: Example, system: str | None = None) -> Rendered:
    """The whole conversation for training."""
    prompt = prompt_ids(tokenizer, example, system)
    reply = tokenizer.encode(assistant_text(example)) + [end_of_turn_id(tokenizer)]
    prompt_mask = [0] * len(prompt)
    if example.trained_prompt_tail:
        start, end = _tail_span(tokenizer, example, system, prompt)
        prompt_mask[start:end] = [1] * (end - start)
    return Rendered(prompt + reply, prompt_mask + [1] * len(reply), len(prompt))
