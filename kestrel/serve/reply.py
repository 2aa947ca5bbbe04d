"""A reply as the server's parsers read it: its reasoning (`kestrel.serve.reasoning_parsers`) first, then its
answer, whose tool calls a tool-call parser (`kestrel.serve.tool_parsers`) tells from its prose. A stream reads
it piece by piece (`ReplyReader.read`), a whole reply in one piece (`read_reply`): the same events either way."""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.serve.reasoning_parsers import ReasoningParser
from kestrel.serve.tool_parsers import CallBegun, Event, Prose, ToolCallParser, read_events


@dataclass
class Reasoning:
    text: str  # more of the reply's reasoning


ReplyEvent = Reasoning | Event


@dataclass
class Parsers:
    """The parsers that read one request's reply (None: that part not read)."""

    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None
    max_calls: int | None = None  # calls past this many are dropped (parallel_tool_calls false: 1)
    calls_end_thought: bool = True  # a call's opening ends a thought left open
    opened: bool = False  # the prompt opened the reasoning (`Server.see_prompt`)

    def __bool__(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def keeps_special_tokens(self) -> bool:
        return any(p is not None and p.keeps_special_tokens for p in (self.reasoning, self.tools))


class ReplyReader:
    def __init__(self, parsers: Parsers):
        stops = parsers.tools.openers if parsers.tools is not None and parsers.calls_end_thought else ()
        reasoning = parsers.reasoning
        self._reasoning = reasoning.stream(parsers.opened, stops) if reasoning is not None else None
        self._tools = parsers.tools.stream() if parsers.tools is not None else None
        self._max_calls = parsers.max_calls
        self.called = False  # a call begun so far
        self._finished = False

    @property
    def reasoning_end(self) -> int:
        """Where the reasoning ends in the reply's text so far (0: none)."""
        return self._reasoning.reasoning_end if self._reasoning is not None else 0

    def read(self, piece: str, finished: bool = False) -> list[ReplyEvent]:
        """The events a piece of the reply adds; `finished`: it is the reply's last."""
        if self._finished:
            return []
        self._finished = finished
        reasoning, answer = "", piece
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.feed(piece)
            if finished:
                more, rest = self._reasoning.finish()
                reasoning, answer = reasoning + more, answer + rest
        events: list[ReplyEvent] = [Reasoning(reasoning)] if reasoning else []
        if self._tools is None:
            return events + ([Prose(answer)] if answer else [])
        read = self._tools.feed(answer) if answer else []
        read += self._tools.finish() if finished else []
        if self._max_calls is not None:
            read = [e for e in read if isinstance(e, Prose) or e.index < self._max_calls]
        self.called = self.called or any(isinstance(e, CallBegun) for e in read)
        return events + read


@dataclass
class Reply:
    reasoning: str | None  # None: no reasoning read
    content: str | None  # None: the reply is calls or reasoning alone
    calls: list[dict]  # OpenAI's tool_calls entries
    reasoning_end: int  # where the reasoning ends in the text (0: none)


def read_reply(parsers: Parsers, text: str) -> Reply:
    reader = ReplyReader(parsers)
    events = reader.read(text, finished=True)
    answer = read_events([e for e in events if not isinstance(e, Reasoning)])
    # (an empty reasoning is none: a stream has nothing of it to send)
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning)) or None
    content = answer.content
    if reasoning is not None and not content:
        content = None
    return Reply(reasoning, content, answer.calls, reader.reasoning_end)
