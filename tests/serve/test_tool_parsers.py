"""The tool-call parsers (`kestrel.serve.tool_parsers`) on their own: a reply's prose and calls read whole, and the
same read from the reply in pieces of every size (a stream's text arrives cut anywhere, markers included)."""

from __future__ import annotations

import json
import random

import pytest

from kestrel.serve.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallBegun,
    CallEnded,
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    HermesParser,
    KimiK2Parser,
    Prose,
    read_events,
    tool_call_parser,
)

KIMI_TWO = (
    "I will look both up."
    "<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
HERMES_TWO = (
    "I will look both up.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "note": "é"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
)

# DeepSeek's markers: full-width bars and U+2581 in their names
CALLS_BEGIN, CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN, CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
DEEPSEEK_V3_TWO = (
    f"I will look both up.{CALLS_BEGIN}"
    f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Oslo"}}\n```{CALL_END}\n'
    f'{CALL_BEGIN}function{SEP}get_time\n```json\n{{"zone": "CET"}}\n```{CALL_END}{CALLS_END}'
)
DEEPSEEK_V31_TWO = (
    f"I will look both up.{CALLS_BEGIN}"
    f'{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo"}}{CALL_END}'
    f'{CALL_BEGIN}get_time{SEP}{{"zone": "CET"}}{CALL_END}{CALLS_END}'
)


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(parser, pieces: list[str]) -> list:
    reader = parser.stream()
    events = []
    for piece in pieces:
        events += reader.feed(piece)
    return events + reader.finish()


def test_kimi_calls_and_prose():
    reply = KimiK2Parser().parse(KIMI_TWO)
    assert reply.content == "I will look both up."
    assert [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls
    ] == [
        ("functions.get_weather:0", "get_weather", {"city": "Oslo"}),
        ("functions.get_time:1", "get_time", {"zone": "CET"}),
    ]
    assert all(c["type"] == "function" for c in reply.calls)


def test_hermes_calls_and_prose():
    reply = HermesParser().parse(HERMES_TWO)
    assert reply.content == "I will look both up."  # the blank lines around the calls are not content
    assert [c["function"]["name"] for c in reply.calls] == ["get_weather", "get_time"]
    assert reply.calls[0]["function"]["arguments"] == '{"city":"Oslo","note":"é"}'
    assert all(c["id"].startswith("call_") for c in reply.calls)
    assert len({c["id"] for c in reply.calls}) == 2


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize(
    "text",
    [
        "Plain prose, no calls.\n\n",
        "  indented, a < sign, <|tool and <tool",  # marker starts that never finish
        "",
        "\n",
    ],
)
def test_a_reply_without_calls_is_its_text_exactly(name, text):
    parser = tool_call_parser(name)
    reply = parser.parse(text)
    assert reply.content == text and reply.calls == []
    for seed in range(5):
        if len(text) > 1:
            assert read_events(_streamed(parser, _pieces(text, random.Random(seed)))) == reply


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (KimiK2Parser(), KIMI_TWO),
        (HermesParser(), HERMES_TWO),
        (DeepSeekV3Parser(), DEEPSEEK_V3_TWO),
        (DeepSeekV31Parser(), DEEPSEEK_V31_TWO),
    ],
)
def test_pieces_of_any_size_read_as_the_whole(parser, text):
    whole = parser.parse(text)
    for seed in range(200):
        events = _streamed(parser, _pieces(text, random.Random(seed)))
        streamed = read_events(events)
        assert streamed.content == whole.content
        assert [c["function"] for c in streamed.calls] == [c["function"] for c in whole.calls]
        markers = ("<|", "<tool", "<\uff5c")
        assert not any(isinstance(e, Prose) and any(m in e.text for m in markers) for e in events)
        begun = [e.index for e in events if isinstance(e, CallBegun)]
        ended = [e.index for e in events if isinstance(e, CallEnded)]
        assert begun == ended == [0, 1]
    one_char = _streamed(parser, list(text))
    assert read_events(one_char).content == whole.content


def test_kimi_arguments_stream_as_they_come():
    reader = KimiK2Parser().stream()
    head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    assert reader.feed(head[:-3]) == []  # the header is not ended: nothing to say yet
    assert reader.feed(head[-3:] + '{"a"') == [CallBegun(0, "functions.f:0", "f"), CallArguments(0, '{"a"')]
    assert reader.feed(": 1}<|tool_call") == [CallArguments(0, ": 1}")]  # a marker's start held back
    assert reader.feed("_end|>") == [CallEnded(0)]
    assert reader.finish() == []


def test_a_cut_reply():
    """The reply's end cuts a call: a Kimi call's arguments so far (the call ended at the end), a Kimi call
    before its arguments dropped; a Hermes block's JSON as far as it came (a string cut short left out), prose
    where its name is not whole."""
    kimi = KimiK2Parser()
    cut = kimi.parse(
        'Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": '
    )
    assert cut.content == "Hi" and cut.calls[0]["function"] == {"name": "f", "arguments": '{"a": '}
    assert kimi.parse("Hi<|tool_calls_section_begin|><|tool_call_begin|>functions.f").calls == []
    hermes = HermesParser()
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}').calls[0]["function"]["name"] == "f"
    cut = hermes.parse('Hi <tool_call>{"name": "f", "arguments": {"a": [1, 2], "b": "unfini')
    assert cut.content == "Hi" and cut.calls[0]["function"] == {"name": "f", "arguments": '{"a":[1,2]}'}
    assert hermes.parse('Hi <tool_call>{"name": "f", "argu').calls[0]["function"] == {
        "name": "f",
        "arguments": "{}",
    }
    open_block = 'Hi <tool_call>{"name": "get_wea'  # (its name not whole: no call)
    assert hermes.parse(open_block) == read_events([Prose(open_block)])


@pytest.mark.parametrize(
    ("block", "call"),
    [
        ('{"name": "f", "parameters": {"a": 1}}', ("f", '{"a":1}')),  # some models say parameters
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', ("f", '{"a": 1}')),  # arguments already a JSON string
        ('{"name": "f"}', ("f", "{}")),
        ('{"arguments": {}}', None),  # no name: not a call
        ("not json", None),
    ],
)
def test_hermes_blocks(block, call):
    reply = HermesParser().parse(f"<tool_call>{block}</tool_call>")
    if call is None:
        assert reply.calls == [] and reply.content == f"<tool_call>{block}</tool_call>"
    else:
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.calls] == [call]
        assert reply.content is None


def test_prose_after_the_calls_and_an_unknown_parser():
    reply = HermesParser().parse('A\n<tool_call>{"name": "f"}</tool_call>\nB\n')
    assert reply.content == "A\nB" and len(reply.calls) == 1
    reply = KimiK2Parser().parse(
        "<|tool_calls_section_begin|><|tool_call_begin|>g<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>Done."
    )
    assert reply.content == "Done." and reply.calls[0]["function"]["name"] == "g"
    assert tool_call_parser(None) is None
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose one of kimi_k2, hermes"):
        tool_call_parser("nope")


def test_kimi_calls_that_skip_a_marker():
    """A call the section's end closes (its own end left out) ends there, the marker not in its arguments; a call
    without its section's opening is a call."""
    reply = KimiK2Parser().parse(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_calls_section_end|>after"
    )
    assert reply.calls[0]["function"] == {"name": "f", "arguments": "{}"} and reply.content == "after"
    bare = KimiK2Parser().parse(
        "Hi<|tool_call_begin|>functions.g:3<|tool_call_argument_begin|>{}<|tool_call_end|>"
    )
    assert bare.content == "Hi" and bare.calls[0]["id"] == "functions.g:3"


def test_a_cut_call_says_so():
    """CallEnded.cut: the reply's end, not the call's own closing, ended it (a Responses item's status)."""
    kimi = KimiK2Parser().stream()
    head = "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}"
    assert kimi.feed(head + "<|tool_call_end|>")[-1] == CallEnded(0, cut=False)
    cut = KimiK2Parser().stream()
    assert [*cut.feed(head), *cut.finish()][-1] == CallEnded(0, cut=True)
    hermes = HermesParser().stream()
    assert [*hermes.feed('<tool_call>{"name": "f"}'), *hermes.finish()][-1] == CallEnded(0, cut=True)


@pytest.mark.parametrize(
    ("parser", "text"), [(DeepSeekV3Parser(), DEEPSEEK_V3_TWO), (DeepSeekV31Parser(), DEEPSEEK_V31_TWO)]
)
def test_deepseek_calls_and_prose(parser, text):
    """DeepSeek V3 / R1 (`function<sep>NAME` and a fenced JSON block) and V3.1 (`NAME<sep>JSON`): the calls'
    names and arguments as written (the fence not in them), ids made here, the section's markers not prose."""
    reply = parser.parse(text + "\nDone.")
    assert reply.content == "I will look both up.\nDone."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", '{"zone": "CET"}'),
    ]
    assert all(c["id"].startswith("call_") for c in reply.calls) and len({c["id"] for c in reply.calls}) == 2
    assert parser.keeps_special_tokens


def test_deepseek_cut_and_unfenced_calls():
    """A V3 call whose arguments the reply's end cuts keeps what came (cut); one cut in its header is dropped; one
    written without the fence ends at its closing marker; JSON holding backticks keeps them."""
    v3 = DeepSeekV3Parser()
    head = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n"
    cut = v3.stream()
    events = [*cut.feed(head + '{"a": '), *cut.finish()]
    assert read_events(events).calls[0]["function"] == {"name": "f", "arguments": '{"a": '}
    assert events[-1] == CallEnded(0, cut=True)
    assert v3.parse(f"Hi{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f").calls == []
    bare = v3.parse(f"{CALL_BEGIN}function{SEP}f\n```json\n{{}}{CALL_END}")
    assert bare.calls[0]["function"] == {"name": "f", "arguments": "{}"} and bare.content is None
    code = '{"code": "```py\\nx = 1\\n```"}'  # (newlines escaped, as JSON has them)
    assert v3.parse(f"{head}{code}\n```{CALL_END}{CALLS_END}").calls[0]["function"]["arguments"] == code


def test_a_call_cut_inside_its_closing_marker_keeps_no_part_of_it():
    """(Where a marker is not one token, the reply's end may cut it: its start is not the arguments'.)"""
    head = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
    for tail in ("<|tool_call_e", "<|tool_calls_sec", "<"):
        assert KimiK2Parser().parse(head + '{"a": 1}' + tail).calls[0]["function"]["arguments"] == '{"a": 1}'
    v3 = DeepSeekV3Parser().parse(f"{CALL_BEGIN}function{SEP}f\n```json\n{{}}\n`")
    assert v3.calls[0]["function"]["arguments"] == "{}"
