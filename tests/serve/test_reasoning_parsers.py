"""The reasoning parsers (`kestrel.serve.reasoning_parsers`) and a reply read by both kinds of parser
(`kestrel.serve.reply`): reasoning told from the answer, whole and in pieces of every size."""

from __future__ import annotations

import json
import random

import pytest

from kestrel.serve.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1Parser,
    KimiK2ReasoningParser,
    Qwen3Parser,
    reasoning_parser,
)
from kestrel.serve.reply import Parsers, Reasoning, ReplyReader, read_reply
from kestrel.serve.tool_parsers import HermesParser, KimiK2Parser, Prose


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "answer"),
    [
        (Qwen3Parser(), "<think>\nAdd them.\n</think>\n\n42", "\nAdd them.\n", "42"),
        (Qwen3Parser(), "  <think>x</think>y", "x", "y"),
        (Qwen3Parser(), "42, no thinking", None, "42, no thinking"),  # thinking off: all answer
        (Qwen3Parser(), "a </think> b", None, "a </think> b"),
        (Qwen3Parser(), "<think>cut short", "cut short", ""),
        (Qwen3Parser(), "<thi", None, "<thi"),
        (DeepSeekR1Parser(), "Add them.</think>42", "Add them.", "42"),  # the template opened <think>
        (DeepSeekR1Parser(), "<think>Add them.</think>\n42", "Add them.", "42"),
        (DeepSeekR1Parser(), "never closed", "never closed", ""),
        (DeepSeekR1Parser(), "", None, ""),
        (KimiK2ReasoningParser(), "<think>k</think>ok", "k", "ok"),
    ],
)
def test_reasoning_and_answer(parser, text, reasoning, answer):
    parsed = parser.parse(text)
    assert (parsed.reasoning, parsed.answer) == (reasoning, answer)
    if reasoning is not None and "</think>" in text:
        assert text[: parsed.reasoning_end].endswith("</think>")
    for seed in range(100):
        rng = random.Random(seed)
        s = parser.stream()
        got_r = got_a = ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 4)
            r, a = s.feed(text[i : i + n])
            got_r, got_a, i = got_r + r, got_a + a, i + n
        r, a = s.finish()
        assert (got_r + r, got_a + a) == ((reasoning or ""), answer)
        assert s.has_reasoning == (reasoning is not None)


def test_an_unknown_parser():
    assert reasoning_parser(None) is None and isinstance(reasoning_parser("qwen3"), Qwen3Parser)
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose one of deepseek_r1"):
        reasoning_parser("r2")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "kimi_k2"}


THINK_THEN_CALL = (
    "<think>The user wants the weather; call the tool.</think>\n"
    "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)


def _in_pieces(parsers: Parsers, text: str, seed: int) -> tuple[ReplyReader, list]:
    """A reply read in seeded random pieces of 1-6 characters: its reader and the events."""
    rng, reader, events, i = random.Random(seed), ReplyReader(parsers), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        events += reader.read(text[i : i + n], finished=i + n >= len(text))
        i += n
    return reader, events


def test_reasoning_then_calls_whole_and_streamed():
    parsers = Parsers(KimiK2ReasoningParser(), KimiK2Parser())
    assert parsers.keeps_special_tokens and not Parsers(Qwen3Parser(), HermesParser()).keeps_special_tokens
    reply = read_reply(parsers, THINK_THEN_CALL)
    assert reply.reasoning == "The user wants the weather; call the tool."
    assert reply.content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert THINK_THEN_CALL[: reply.reasoning_end].endswith("</think>")
    for seed in range(100):
        reader, events = _in_pieces(parsers, THINK_THEN_CALL, seed)
        assert "".join(e.text for e in events if isinstance(e, Reasoning)) == reply.reasoning
        assert "".join(e.text for e in events if isinstance(e, Prose)) == reply.content
        assert reader.called
        kinds = [type(e).__name__ for e in events]
        assert kinds.index("Prose") > max(k for k, name in enumerate(kinds) if name == "Reasoning")


def test_a_reply_of_reasoning_alone_has_no_content():
    reply = read_reply(Parsers(Qwen3Parser()), "<think>still thinking")
    assert (reply.reasoning, reply.content, reply.calls) == ("still thinking", None, [])
    reply = read_reply(Parsers(Qwen3Parser()), "plain")
    assert (reply.reasoning, reply.content, reply.reasoning_end) == (None, "plain", 0)


@pytest.mark.parametrize(
    ("parsers", "text"),
    [
        (
            Parsers(KimiK2ReasoningParser(), KimiK2Parser()),
            "<think>I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
        ),
        (
            Parsers(Qwen3Parser(), HermesParser()),
            '<think>I\'ll check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        ),
        (
            Parsers(DeepSeekR1Parser(), HermesParser()),
            'I\'ll check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        ),
    ],
)
def test_a_call_from_inside_an_unclosed_thought_ends_it(parsers, text):
    """Thinking models call tools without closing their thought: the call's opening ends the reasoning."""
    reply = read_reply(parsers, text)
    assert reply.reasoning.strip() == "I'll check." and reply.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    for seed in range(50):
        reader, events = _in_pieces(parsers, text, seed)
        assert "".join(e.text for e in events if isinstance(e, Reasoning)) == reply.reasoning
        assert reader.called


def test_a_prompt_that_opened_the_thought():
    """qwen3 and kimi_k2: a template that opens <think> in the prompt (thinking on) leaves the reply inside it."""
    text = "2+2 is basic.\n</think>\n\n4"
    assert read_reply(Parsers(Qwen3Parser()), text).reasoning is None  # thinking off: all answer
    reply = read_reply(Parsers(Qwen3Parser(), opened=True), text)
    assert (reply.reasoning, reply.content) == ("2+2 is basic.\n", "4")
    assert Qwen3Parser().parse(text, opened=True).answer == "4"


def test_an_empty_thought_is_no_reasoning():
    """Streamed, an empty thought sends nothing: whole, it is no reasoning either."""
    for parsers, text in (
        (Parsers(Qwen3Parser()), "<think></think>4"),
        (Parsers(DeepSeekR1Parser()), "</think>4"),
    ):
        reply = read_reply(parsers, text)
        assert (reply.reasoning, reply.content) == (None, "4")
        assert not [e for e in ReplyReader(parsers).read(text, finished=True) if isinstance(e, Reasoning)]


def test_parallel_tool_calls_false_keeps_the_first():
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert len(read_reply(Parsers(tools=HermesParser()), text).calls) == 2
    (only,) = read_reply(Parsers(tools=HermesParser(), max_calls=1), text).calls
    assert only["function"]["name"] == "a"


def test_under_a_constraint_a_call_inside_the_thought_is_thought():
    """A constraint holds after the thought: a call's opening inside it is the thought's text, not a call."""
    text = 'I could <tool_call>{"name": "f"}</tool_call> maybe</think>{"a":1}'
    reply = read_reply(Parsers(DeepSeekR1Parser(), HermesParser(), calls_end_thought=False), text)
    assert (
        reply.reasoning.startswith("I could <tool_call>") and reply.content == '{"a":1}' and not reply.calls
    )
