"""Reasoning parsers: a thinking model's reasoning told apart from its answer (vLLM's and SGLang's
`--reasoning-parser`). The reasoning is what the model writes between `<think>` and `</think>`; the answer is the
rest, which the chat route returns as `content` (and reads for tool calls) and the reasoning as
`reasoning_content` (SGLang's and DeepSeek's name, vLLM's before 0.11) and `reasoning` (vLLM's now).

- `deepseek_r1`: the reply starts inside its reasoning (DeepSeek R1's template opens `<think>` in the prompt;
  a `<think>` the model writes itself is dropped too) and the answer starts after `</think>`. A reply that never
  closes its reasoning is all reasoning.
- `qwen3`, `kimi_k2` (Kimi K2 Thinking, K3): reasoning where the reply opens with `<think>`, or where the prompt
  ends with it (the template opened it); otherwise thinking is off and the whole reply is the answer. Kimi's
  think markers may be special tokens, which such a reply's text keeps.

A tool call's opening (the server's tool-call parser's) inside the reasoning ends it: thinking models call tools
from an unclosed thought. Whitespace between `</think>` and the answer is not part of the answer. A stream's
pieces are read as the whole (a marker may arrive cut anywhere); a marker's possible start is held back until it
is told apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kestrel.serve.tool_parsers import first_marker, named_parser

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ParsedReasoning:
    reasoning: str | None  # None: the reply has no reasoning
    answer: str
    reasoning_end: int  # where the reasoning ends in the reply's text, its closing marker included (0: none)


class ReasoningStream:
    """One reply's reader: `feed` each piece as it arrives, `finish` once it has ended; each returns the
    (reasoning, answer) text it adds."""

    def __init__(self, opens_inside: bool, stops: tuple[str, ...] = ()):
        """`opens_inside`: the reply starts inside its reasoning; `stops`: markers that end the reasoning without
        its `</think>` and begin the answer (a tool call's opening: thinking models call tools from inside an
        unclosed thought)."""
        self._state = "start"  # start | reasoning | gap (after </think>, before the answer) | answer
        self._opens_inside = opens_inside
        self._stops = stops
        self._buffer = ""
        self.seen = 0  # the reply's text read so far
        self.reasoning_end = 0
        self.has_reasoning = False

    def feed(self, piece: str) -> tuple[str, str]:
        self._buffer += piece
        self.seen += len(piece)
        return self._read(final=False)

    def finish(self) -> tuple[str, str]:
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, str]:
        reasoning = answer = ""
        while self._buffer:
            if self._state == "start":
                head = self._buffer.lstrip()
                if head.startswith(OPEN):
                    self._buffer, self._state = head[len(OPEN) :], "reasoning"
                elif OPEN.startswith(head) and not final:
                    break  # `<think>` may be arriving
                else:
                    self._state = "reasoning" if self._opens_inside else "answer"
                self.has_reasoning = self._state == "reasoning"
            elif self._state == "reasoning":
                at, marker = first_marker(self._buffer, (CLOSE, *self._stops), final)
                reasoning, self._buffer = reasoning + self._buffer[:at], self._buffer[at:]
                if marker is None:
                    break  # (what is left may be a marker's start)
                if marker == CLOSE:
                    self._buffer, self._state = self._buffer[len(CLOSE) :], "gap"
                else:  # (the marker stays: the answer starts with it)
                    self._state = "answer"
                self.reasoning_end = self.seen - len(self._buffer)
            elif self._state == "gap":
                self._buffer = self._buffer.lstrip()
                if self._buffer:
                    self._state = "answer"
            else:
                answer, self._buffer = answer + self._buffer, ""
        if final and self._state == "reasoning":
            self.reasoning_end = self.seen
        return reasoning, answer


class ReasoningParser:
    opens_inside: ClassVar[bool] = False  # the reply starts inside its reasoning, whatever the prompt
    keeps_special_tokens: ClassVar[bool] = False

    def stream(self, opened: bool = False, stops: tuple[str, ...] = ()) -> ReasoningStream:
        """`opened`: the prompt ends with `<think>` (the template opened the reasoning, as Qwen 3's thinking
        templates and Kimi's do): the reply starts inside it."""
        return ReasoningStream(self.opens_inside or opened, stops)

    def parse(self, text: str, opened: bool = False) -> ParsedReasoning:
        s = self.stream(opened)
        (r1, a1), (r2, a2) = s.feed(text), s.finish()
        return ParsedReasoning((r1 + r2) if s.has_reasoning else None, a1 + a2, s.reasoning_end)


class DeepSeekR1Parser(ReasoningParser):
    opens_inside = True


class Qwen3Parser(ReasoningParser):
    pass


class KimiK2ReasoningParser(ReasoningParser):
    keeps_special_tokens = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
    "kimi_k2": KimiK2ReasoningParser,
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    return named_parser(REASONING_PARSERS, "reasoning", name)
