"""Tool-call parsers: the calls a model writes in its own format, read out of its text (vLLM's and SGLang's
`--tool-call-parser`), which is what `tool_choice: "auto"` needs: the model decides whether to call, and the
server tells its calls from its prose.

- `kimi_k2` (Kimi K2 and its successors): `<|tool_calls_section_begin|>` then, for each call,
  `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then
  `<|tool_calls_section_end|>`. The markers are special tokens of Kimi's tokenizer, so a request read by this
  parser keeps special tokens in its text. The call's id is the model's own `functions.NAME:IDX`, which Kimi's
  chat template writes back beside the call's result.
- `hermes` (also `qwen25`: Hermes, Qwen 2.5 and Qwen 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block a call; the ids are made here.
- `deepseek_v3` (DeepSeek V3 and R1): `<｜tool▁calls▁begin｜>` then, for each call,
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments in a fenced JSON block (```json ... ```),
  `<｜tool▁call▁end｜>`; then `<｜tool▁calls▁end｜>`. `deepseek_v31` (V3.1): the same section, each call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`. Special tokens kept, as Kimi's; ids made here.

A parser reads a reply piece by piece (`ToolCallStream.feed`, as the stream's text arrives) and says what each
piece adds: prose, a call begun (its id and name), a call's argument text, a call ended. The whole reply is read
the same way (`parse`), so a stream's pieces add up to the whole reply's message. Prose is held back only where
it may be the start of a marker, and whitespace only where a call may follow it: the blank lines a model writes
before a call, and after its last, are not content.

Arguments are the model's text as written: its JSON is not held to the function's schema (tool_choice "required"
or a named function does that, through structured outputs). A Kimi call cut before its arguments began is
dropped; a Hermes block that is not a call's JSON is prose, and one the reply's end cut is a call with its
arguments as far as they came where its name is whole (prose otherwise).
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pydantic_core import from_json


@dataclass
class Prose:
    text: str


@dataclass
class CallBegun:
    index: int  # the call's place among the reply's calls
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str  # more of the call's arguments


@dataclass
class CallEnded:
    index: int
    cut: bool = False  # ended by the reply's end, not by its own closing


Event = Prose | CallBegun | CallArguments | CallEnded


@dataclass
class ParsedReply:
    """A whole reply: its prose (None where it made calls and wrote nothing else) and its calls, as OpenAI's
    message holds them (`{"id", "type": "function", "function": {"name", "arguments"}}`)."""

    content: str | None
    calls: list[dict]


class ToolCallStream(ABC):
    """One reply's reader: `feed` each piece of text as it arrives, `finish` once it has ended."""

    def __init__(self):
        self._buffer = ""  # text not yet read (a marker's possible start, a Hermes block)
        self._space = ""  # whitespace held back: shown only if prose follows it
        self._calls = 0
        self._finished = False
        self._searched = 0  # (`_find`'s)

    def feed(self, piece: str) -> list[Event]:
        assert not self._finished, "feed after finish"
        self._buffer += piece
        events: list[Event] = []
        self._read(events, final=False)
        return events

    def finish(self) -> list[Event]:
        """What the held-back text adds once the reply has ended."""
        self._finished = True
        events: list[Event] = []
        self._read(events, final=True)
        if self._space and not self._calls:  # no call: the reply's prose exactly as written
            events.append(Prose(self._space))
        self._space = ""
        return events

    @abstractmethod
    def _read(self, events: list[Event], final: bool) -> None:
        """Read as much of the buffer as can be read now (all of it where `final`)."""

    def _prose(self, events: list[Event], text: str) -> None:
        """Prose, its trailing whitespace held back until something other than a call follows it."""
        text = self._space + text
        shown = text.rstrip()
        self._space = text[len(shown) :]
        if shown:
            events.append(Prose(shown))

    def _begin_call(self, events: list[Event], call_id: str, name: str) -> int:
        self._space = ""  # the blank before a call is not prose
        index, self._calls = self._calls, self._calls + 1
        events.append(CallBegun(index, call_id, name))
        return index

    def _until(self, markers: tuple[str, ...], final: bool) -> tuple[str, str | None]:
        """The buffer's text before the first of `markers` and that marker (then consumed); where none is found,
        all of the buffer but a tail that may be a marker's start (all of it where `final`), and None."""
        at, marker = first_marker(self._buffer, markers, final)
        text, self._buffer = self._buffer[:at], self._buffer[at + len(marker or "") :]
        return text, marker

    def _find(self, marker: str) -> int:
        """Where `marker` starts in a buffer that is read whole once it ends (a Hermes block, a Kimi header), or
        -1; a buffer searched before is searched again only past what was searched (a long block arriving in
        small pieces was searched from its start at each)."""
        at = self._buffer.find(marker, max(0, self._searched - len(marker) + 1))
        self._searched = len(self._buffer) if at < 0 else 0
        return at


def call_id() -> str:
    """A call id made here (OpenAI's form), for formats whose calls carry none."""
    return f"call_{uuid.uuid4().hex[:24]}"


def first_marker(text: str, markers: tuple[str, ...], final: bool) -> tuple[int, str | None]:
    """Where the first of `markers` starts in `text`, and which; where none is found, how much of the text can be
    read (all but a tail that may be a marker's start, all where `final`) and None."""
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    if found:
        return min(found)
    return len(text) - (0 if final else max(partial_tail(text, m) for m in markers)), None


def partial_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (a marker still arriving)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser(ABC):
    """A model's tool-call format."""

    name: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens, which the text must keep
    openers: ClassVar[tuple[str, ...]]  # the markers a call (or calls) begins with

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    def parse(self, text: str) -> ParsedReply:
        """A whole reply, read as a stream of one piece."""
        s = self.stream()
        return read_events([*s.feed(text), *s.finish()])


def read_events(events: list[Event]) -> ParsedReply:
    """The message a reply's events add up to."""
    prose, calls = [], []
    for e in events:
        if isinstance(e, Prose):
            prose.append(e.text)
        elif isinstance(e, CallBegun):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, CallArguments):
            calls[e.index]["function"]["arguments"] += e.text
    content = "".join(prose)
    return ParsedReply(content or (None if calls else ""), calls)


class _SectionStream(ToolCallStream):
    """Calls in a section of marker tokens (Kimi's, DeepSeek's): the section's opening, then for each call its
    opening, a header (the call's id or name) up to `ARGUMENTS_BEGIN`, its arguments up to one of
    `ARGUMENTS_END`, and its closing; then the section's closing. A call without the section's opening is a call
    too; a call the section's end closes (its own end left out) ends there too; between calls, anything is
    dropped."""

    SECTION_BEGIN: ClassVar[tuple[str, ...]]
    SECTION_END: ClassVar[tuple[str, ...]]
    CALL_BEGIN: ClassVar[str]
    ARGUMENTS_BEGIN: ClassVar[str]
    ARGUMENTS_END: ClassVar[tuple[str, ...]]  # (the first: the call's own closing)

    def __init__(self):
        super().__init__()
        self._state = "prose"  # prose | section | header | arguments
        self._index = -1  # the call whose arguments are being read
        self._begun = False  # (its arguments' first text: leading whitespace dropped)

    @abstractmethod
    def _header(self, header: str) -> tuple[str, str]:
        """A call's id and function name from the text between its opening and its arguments."""

    def _read(self, events: list[Event], final: bool) -> None:
        while True:
            if self._state == "prose":
                text, marker = self._until((*self.SECTION_BEGIN, self.CALL_BEGIN), final)
                self._prose(events, text)
                if marker is None:
                    return
                self._state = "header" if marker == self.CALL_BEGIN else "section"
            elif self._state == "section":
                _, marker = self._until((self.CALL_BEGIN, *self.SECTION_END), final)
                if marker is None:
                    return
                self._state = "header" if marker == self.CALL_BEGIN else "prose"
            elif self._state == "header":  # read whole
                at = self._find(self.ARGUMENTS_BEGIN)
                if at < 0:  # not ended yet (or never: a call cut before its arguments is dropped)
                    if final:
                        self._buffer = ""
                    return
                call_id, name = self._header(self._buffer[:at].strip())
                self._buffer = self._buffer[at + len(self.ARGUMENTS_BEGIN) :]
                self._index = self._begin_call(events, call_id, name)
                self._state, self._begun = "arguments", False
            else:
                ends = (*self.ARGUMENTS_END, *self.SECTION_END)
                text, marker = self._until(ends, final)
                if marker is None and final:  # cut inside a closing marker (its start not the arguments')
                    text = text[: len(text) - max(partial_tail(text, m) for m in ends)]
                if not self._begun:
                    text = text.lstrip()
                    self._begun = bool(text)
                if text:
                    events.append(CallArguments(self._index, text))
                if marker is None:
                    if final:
                        events.append(CallEnded(self._index, cut=True))
                    return
                events.append(CallEnded(self._index))
                self._state = "prose" if marker in self.SECTION_END else "section"


class _KimiStream(_SectionStream):
    # (some write the section's markers singular)
    SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    CALL_BEGIN = "<|tool_call_begin|>"
    ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
    ARGUMENTS_END = ("<|tool_call_end|>",)

    def _header(self, header: str) -> tuple[str, str]:
        name = header.rpartition(":")[0] if ":" in header else header  # functions.NAME:IDX
        return header, name.removeprefix("functions.")


class KimiK2Parser(ToolCallParser):
    name = "kimi_k2"
    keeps_special_tokens = True
    openers = (*_KimiStream.SECTION_BEGIN, _KimiStream.CALL_BEGIN)

    def stream(self) -> ToolCallStream:
        return _KimiStream()


class _DeepSeekV3Stream(_SectionStream):
    # DeepSeek V3 and R1: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>
    SECTION_BEGIN = ("<\uff5ctool\u2581calls\u2581begin\uff5c>",)
    SECTION_END = ("<\uff5ctool\u2581calls\u2581end\uff5c>",)
    CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
    SEPARATOR = "<\uff5ctool\u2581sep\uff5c>"
    CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
    ARGUMENTS_BEGIN = "```json"
    # (a JSON value holds no raw newline but as whitespace, which a fence cannot follow: the fence's end is found)
    ARGUMENTS_END = (CALL_END, "\n```")

    def _header(self, header: str) -> tuple[str, str]:
        return call_id(), header.rpartition(self.SEPARATOR)[2].strip()


class _DeepSeekV31Stream(_DeepSeekV3Stream):
    # DeepSeek V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
    ARGUMENTS_BEGIN = _DeepSeekV3Stream.SEPARATOR
    ARGUMENTS_END = (_DeepSeekV3Stream.CALL_END,)

    def _header(self, header: str) -> tuple[str, str]:
        return call_id(), header


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseek_v3"
    keeps_special_tokens = True
    openers = (*_DeepSeekV3Stream.SECTION_BEGIN, _DeepSeekV3Stream.CALL_BEGIN)

    def stream(self) -> ToolCallStream:
        return _DeepSeekV3Stream()


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"

    def stream(self) -> ToolCallStream:
        return _DeepSeekV31Stream()


class _HermesStream(ToolCallStream):
    BEGIN, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._in_call = False

    def _read(self, events: list[Event], final: bool) -> None:
        while True:
            if not self._in_call:
                text, marker = self._until((self.BEGIN,), final)
                self._prose(events, text)
                if marker is None:
                    return
                self._in_call = True
            # a block is read whole: its JSON names the function before its arguments
            at = self._find(self.END)
            if at < 0 and not final:
                return
            block = self._buffer if at < 0 else self._buffer[:at]
            self._buffer = "" if at < 0 else self._buffer[at + len(self.END) :]
            self._in_call = False
            call = _hermes_call(block, cut=at < 0)
            if call is None:  # not a call's JSON: the block is prose, as written
                self._prose(events, self.BEGIN + block + (self.END if at >= 0 else ""))
            else:
                index = self._begin_call(events, call_id(), call[0])
                events += [CallArguments(index, call[1]), CallEnded(index, cut=at < 0)]
            if at < 0:
                return


def _hermes_call(block: str, cut: bool = False) -> tuple[str, str] | None:
    """A block's function name and arguments (compact JSON), or None where it is not `{"name": ..., "arguments":
    {...}}` (some models write `parameters`). `cut`: the reply's end cut the block: its JSON as far as it came
    (a string cut short left out), a call where its name is whole."""
    try:
        call = from_json(block, allow_partial=cut)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # arguments already as a JSON string
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


class HermesParser(ToolCallParser):
    name = "hermes"
    openers = (_HermesStream.BEGIN,)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "kimi_k2": KimiK2Parser,
    "hermes": HermesParser,
    "qwen25": HermesParser,  # SGLang's name for the same format
    "deepseek_v3": DeepSeekV3Parser,  # (also R1)
    "deepseek_v31": DeepSeekV31Parser,
}


def tool_call_parser(name: str | None) -> ToolCallParser | None:
    return named_parser(TOOL_CALL_PARSERS, "tool-call", name)


def named_parser(registry: dict[str, type], kind: str, name: str | None):
    """The parser of that name from a registry (None for None); a ValueError that lists the names otherwise."""
    if name is None:
        return None
    if name not in registry:
        raise ValueError(f"unknown {kind} parser {name!r}; choose one of {', '.join(registry)}")
    return registry[name]()
