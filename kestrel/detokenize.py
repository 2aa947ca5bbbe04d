"""Generated ids as streamed text: pieces that never split a UTF-8 character, cut at the first stop string.
The engine, the offline API and the server all stream through these two."""

from __future__ import annotations

from kestrel.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated ids into text pieces for streaming, never splitting a UTF-8 character.

    Each step decodes a short window (the previous step's ids plus the new ones) and emits what the new ids
    added to the window's text; with that left context, tokenizers whose decode is not concatenative still
    produce the right spacing. Text ending in U+FFFD is held back until later ids complete the character.
    """

    _PROMPT_CONTEXT = 5  # prompt ids decoded as left context for the first generated ids

    def __init__(self, tokenizer: Tokenizer, prompt_ids=None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = [int(i) for i in (prompt_ids or [])][-self._PROMPT_CONTEXT :]
        self._prefix_offset = 0  # window start: ids already emitted, decoded only as context
        self._read_offset = len(self._ids)  # ids from here on have not been emitted
        self._held = ""  # their text as the last step decoded it (ends in U+FFFD while a character is open)

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(int(i) for i in token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        return self._advance(final=True)

    def held(self) -> str:
        """The text of the ids added but not emitted yet (it ends in U+FFFD), from the last step's decode."""
        return self._held

    def _advance(self, final: bool) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        text = decode(self._ids[self._prefix_offset :])
        self._held = text[len(prefix_text) :]
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        new, self._held = self._held, ""
        return new


class StopStringMatcher:
    """Cuts streamed text at the first stop string (after it with `include`), holding back any tail that may
    begin one."""

    def __init__(self, stop_strings: list[str], include: bool = False):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = list(stop_strings)
        self.include = include
        self.stopped = False
        self.matched: str | None = None  # the stop string reached
        self._held = ""

    def feed(self, new_text: str, armed_from: int = 0) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has been reached). Only a stop string that ends
        past new_text[:armed_from] counts (min_tokens: the text before was made by the tokens before it); its
        start may lie before, in the tail held back."""
        if self.stopped:
            return "", True
        text = self._held + new_text
        floor = len(self._held) + armed_from  # a hit ends past here (none ends inside the held tail)
        hits = [
            (i, -len(s))
            for i, s in ((text.find(s, max(0, floor - len(s) + 1)), s) for s in self.stop_strings)
        ]
        hits = [hit for hit in hits if hit[0] >= 0]
        if hits:
            self.stopped, self._held = True, ""
            at, minus_len = min(hits)  # the first to start; of those starting there, the longest
            self.matched = text[at : at - minus_len]
            return text[: at - minus_len if self.include else at], True
        keep = max((self._partial_match(text, s) for s in self.stop_strings), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """At the end of generation, the held-back tail was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    @staticmethod
    def _partial_match(text: str, stop: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0
