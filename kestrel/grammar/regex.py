"""A regular expression as a byte-level automaton: the pattern is parsed (a subset of Python's `re` syntax), built
into a Thompson NFA over UTF-8 bytes, and determinized lazily (`Automaton`: a DFA state is a set of NFA states,
made when first reached), so that a pattern whose full DFA would be huge (a JSON schema's) costs only the
states a generation visits.

Matching is whole-string (`re.fullmatch`'s). Supported: literals and escapes (`\\n \\t \\xHH \\uHHHH`, escaped
metacharacters), `.`, classes `[...]` / `[^...]` with ranges, `\\d \\w \\s` and their negations (ASCII, as
`re.ASCII`), groups `(...)` `(?:...)` `(?P<name>...)`, `|`, `* + ? {m} {m,} {m,n}` (a lazy `?` after one
matches the same strings), `^` at the start and `$` at the end. Refused with a `PatternError`: anchors
elsewhere, lookaround, backreferences, inline flags, possessive quantifiers, word boundaries, and classes
that negate or range over more than a few non-ASCII characters.

A character class stands for whole characters: its ASCII members as one byte edge, each non-ASCII member as
its UTF-8 bytes, and a negated class (or `.`) also for every multi-byte UTF-8 character.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The NFA may not grow past this many states (a `{m,n}` copies its body n times).
MAX_NFA_STATES = 400_000
# A class range over non-ASCII characters is spelled out up to this many characters.
MAX_CLASS_RANGE = 1024
# A DFA state may stand for at most this many NFA states: each of its transitions costs a walk over them, and a
# pattern whose repeats overlap (`(?:[a-z]{1,200}){1,200}`) grows sets of tens of thousands, seconds a token.
MAX_STATE_SET = 4096

_ALL_ASCII = frozenset(range(128))
_DIGITS = frozenset(range(ord("0"), ord("9") + 1))
_WORD = _DIGITS | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {95}
_SPACE = frozenset(b" \t\n\r\f\v")
_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7, "0": 0}
_META = set("\\.^$*+?{}[]()|/-\"'#&~ ,:;<>=!@%`")  # escaped punctuation stands for itself


class PatternError(ValueError):
    """A pattern this module cannot compile; the message says where."""


@dataclass(frozen=True)
class _Class:
    """A set of characters: ASCII bytes, explicit non-ASCII characters, and (negated classes, `.`) every
    multi-byte character."""

    ascii: frozenset = frozenset()
    extra: frozenset = frozenset()
    multibyte: bool = False


# -- parsing: pattern -> tree of ("seq", [..]) ("alt", [..]) ("rep", node, lo, hi|None) ("lit", bytes) ("class", _Class)
class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0

    def fail(self, message: str, at: int | None = None):
        at = self.i if at is None else at
        raise PatternError(f"{message} at position {at} of the pattern")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    def parse(self):
        start, end = _anchor_span(self.p)
        self.p, self.i = self.p[:end], start
        node = self.alternation()
        if self.i < len(self.p):
            self.fail("unbalanced ')'")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.quantified(self.atom()))
        return ("seq", items)

    def atom(self):
        at, c = self.i, self.take()
        if c == "(":
            return self.group(at)
        if c == "[":
            return ("class", self.char_class(at))
        if c == ".":
            return ("class", _Class(ascii=_ALL_ASCII - {10}, multibyte=True))
        if c == "\\":
            return self.escape(at, in_class=False)
        if c in "^$":
            self.fail(f"anchor {c!r} only at the start or the end", at)
        if c in "*+?":
            self.fail(f"nothing to repeat before {c!r}", at)
        if c == "{" and self._quantifier_ahead(at):
            self.fail("nothing to repeat before '{'", at)
        return ("lit", c.encode("utf-8"))

    def group(self, at: int):
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?P<", self.i) or (
            self.p.startswith("?<", self.i) and self.p[self.i + 2 : self.i + 3] not in ("=", "!")
        ):
            close = self.p.find(">", self.i)
            if close < 0:
                self.fail("unterminated group name", at)
            self.i = close + 1
        elif self.peek() == "?":
            kind = self.p[self.i : self.i + 3]
            what = "lookaround" if kind[:2] in ("?=", "?!") or kind in ("?<=", "?<!") else "inline flags"
            self.fail(f"'({kind}...' ({what}) is not supported", at)
        node = self.alternation()
        if self.peek() != ")":
            self.fail("missing ')'", at)
        self.take()
        return node

    def _quantifier_ahead(self, at: int) -> bool:
        close = self.p.find("}", at)
        body = self.p[at + 1 : close] if close > 0 else ""
        lo, comma, hi = body.partition(",")
        # (Python's: `{,n}` is `{0,n}` and `{,}` is `*`; a brace with anything else in it is a literal)
        return close > 0 and (lo.isdigit() or (comma and lo == "")) and (hi == "" or hi.isdigit())

    def quantified(self, node):
        while True:
            at, c = self.i, self.peek()
            if c == "*":
                lo, hi = 0, None
            elif c == "+":
                lo, hi = 1, None
            elif c == "?":
                lo, hi = 0, 1
            elif c == "{" and self._quantifier_ahead(at):
                close = self.p.find("}", at)
                body = self.p[at + 1 : close]
                lo_s, comma, hi_s = body.partition(",")
                lo = int(lo_s or 0)
                hi = lo if not comma else (int(hi_s) if hi_s else None)
                if hi is not None and hi < lo:
                    self.fail(f"repeat {{{body}}} has its maximum below its minimum", at)
                self.i = close
            else:
                return node
            self.take()
            if self.peek() == "?":
                self.take()  # lazy: the same strings
            elif self.peek() == "+":
                self.fail("possessive quantifiers are not supported")
            if node[0] == "rep":
                self.fail("multiple repeat", at)
            node = ("rep", node, lo, hi)

    def escape(self, at: int, in_class: bool):
        if self.peek() is None:
            self.fail("a pattern cannot end with '\\'", at)
        c = self.take()
        named = {"d": _DIGITS, "w": _WORD, "s": _SPACE}
        if c.lower() in named:
            members = named[c.lower()]
            cls = _Class(ascii=members) if c.islower() else _Class(ascii=_ALL_ASCII - members, multibyte=True)
            return cls if in_class else ("class", cls)
        if c in _ESCAPES:
            char = chr(_ESCAPES[c])
        elif c in "xu":
            digits = 2 if c == "x" else 4
            hexs = self.p[self.i : self.i + digits]
            if len(hexs) != digits or any(h not in "0123456789abcdefABCDEF" for h in hexs):
                self.fail(f"\\{c} needs {digits} hex digits", at)
            self.i += digits
            char = chr(int(hexs, 16))
        elif c == "b" and in_class:
            char = "\b"
        elif c in _META or not (c.isalnum() or c == "_"):
            char = c
        else:
            self.fail(f"escape '\\{c}' is not supported (backreferences, boundaries and anchors are not)", at)
        return char if in_class else ("lit", _encode(char, self, at))

    def char_class(self, at: int) -> _Class:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ascii_set, extra, multibyte = set(), set(), False
        first = True
        while True:
            c = self.peek()
            if c is None:
                self.fail("unterminated character class", at)
            if c == "]" and not first:
                self.take()
                break
            first = False
            item = self.class_item()
            if isinstance(item, _Class):
                ascii_set |= item.ascii
                extra |= item.extra
                multibyte |= item.multibyte
                continue
            if self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.take()
                hi = self.class_item()
                if isinstance(hi, _Class):
                    self.fail("a range cannot end in a class escape", at)
                if ord(hi) < ord(item):
                    self.fail(f"bad range {item!r}-{hi!r}", at)
                lo_o, hi_o = ord(item), ord(hi)
                ascii_set |= set(range(lo_o, min(hi_o, 127) + 1))
                if hi_o >= 128:
                    if hi_o - max(lo_o, 128) + 1 > MAX_CLASS_RANGE:
                        self.fail(f"a range of more than {MAX_CLASS_RANGE} non-ASCII characters", at)
                    extra |= {chr(o) for o in range(max(lo_o, 128), hi_o + 1)}
            elif ord(item) < 128:
                ascii_set.add(ord(item))
            else:
                extra.add(item)
        if not negated:
            return _Class(frozenset(ascii_set), frozenset(extra), multibyte)
        if extra or multibyte:
            self.fail("a negated class cannot hold non-ASCII characters or \\D \\W \\S", at)
        return _Class(_ALL_ASCII - frozenset(ascii_set), frozenset(), True)

    def class_item(self):
        at, c = self.i, self.take()
        if c == "\\":
            return self.escape(at, in_class=True)
        if c == "[" and self.peek() == ":":
            self.fail("POSIX classes '[:...:]' are not supported", at)
        return c


def check_pattern(pattern: str) -> None:
    """PatternError where `pattern` does not parse (what `Automaton` would refuse, short of its size)."""
    if not isinstance(pattern, str):
        raise PatternError("a pattern must be a string")
    _parse(pattern)


def _parse(pattern: str):
    try:
        return _Parser(pattern).parse()
    except RecursionError:
        raise PatternError("the pattern nests its groups too deeply") from None


def _anchor_span(p: str) -> tuple[int, int]:
    """Where a pattern's body lies: after a leading `^`, before a trailing `$` that is not escaped."""
    start, end = (1 if p.startswith("^") else 0), len(p)
    if end > start and p.endswith("$") and not _escaped(p, end - 1):
        end -= 1
    return start, end


def unanchored(pattern: str) -> str:
    """The pattern without its leading `^` and trailing `$` (a whole-output match holds them anyway), to be put
    inside a larger one."""
    start, end = _anchor_span(pattern)
    return pattern[start:end]


def _escaped(p: str, i: int) -> bool:
    slashes = 0
    while i - 1 - slashes >= 0 and p[i - 1 - slashes] == "\\":
        slashes += 1
    return slashes % 2 == 1


def _encode(char: str, parser: _Parser, at: int) -> bytes:
    try:
        return char.encode("utf-8")
    except UnicodeEncodeError:
        parser.fail("a lone surrogate is not a character", at)


# -- the NFA: each state has at most one byte edge (a set of bytes, as a 256-bit mask) and any epsilon edges
_CONT = (0x80, 0xBF)
# every multi-byte UTF-8 character: lead byte range, then the number of continuation bytes
_MULTIBYTE = (((0xC2, 0xDF), 1), ((0xE0, 0xEF), 2), ((0xF0, 0xF4), 3))


def _mask(lo: int, hi: int) -> int:
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


class _NFA:
    def __init__(self):
        self.edge_mask: list[int] = []
        self.edge_to: list[int] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise PatternError(f"the pattern is too large (over {MAX_NFA_STATES} automaton states)")
        self.edge_mask.append(0)
        self.edge_to.append(-1)
        self.eps.append([])
        return len(self.eps) - 1

    def byte_edge(self, mask: int) -> tuple[int, int]:
        s, t = self.state(), self.state()
        self.edge_mask[s], self.edge_to[s] = mask, t
        return s, t

    def chain(self, masks: list[int]) -> tuple[int, int]:
        start = end = self.state()
        for m in masks:
            s, t = self.byte_edge(m)
            self.eps[end].append(s)
            end = t
        return start, end

    def build(self, node) -> tuple[int, int]:
        """(entry, exit) states of a fragment for `node`."""
        kind = node[0]
        if kind == "lit":
            return self.chain([1 << b for b in node[1]])
        if kind == "class":
            return self.char_class(node[1])
        if kind == "seq":
            start = end = self.state()
            for item in node[1]:
                s, t = self.build(item)
                self.eps[end].append(s)
                end = t
            return start, end
        if kind == "alt":
            start, end = self.state(), self.state()
            for branch in node[1]:
                s, t = self.build(branch)
                self.eps[start].append(s)
                self.eps[t].append(end)
            return start, end
        _, body, lo, hi = node
        start = end = self.state()
        for _ in range(lo):
            s, t = self.build(body)
            self.eps[end].append(s)
            end = t
        if hi is None:  # a loop: body zero or more times
            s, t = self.build(body)
            loop = self.state()
            self.eps[end].append(loop)
            self.eps[loop].append(s)
            self.eps[t].append(loop)
            return start, loop
        done = self.state()
        for _ in range(hi - lo):
            self.eps[end].append(done)
            s, t = self.build(body)
            self.eps[end].append(s)
            end = t
        self.eps[end].append(done)
        return start, done

    def char_class(self, cls: _Class) -> tuple[int, int]:
        start, end = self.state(), self.state()
        ascii_mask = sum(1 << b for b in cls.ascii)
        paths = [[ascii_mask]] if ascii_mask else []
        paths += [[1 << b for b in c.encode("utf-8")] for c in sorted(cls.extra)]
        if cls.multibyte:
            paths += [[_mask(*lead)] + [_mask(*_CONT)] * n for lead, n in _MULTIBYTE]
        for masks in paths:
            s, t = self.chain(masks)
            self.eps[start].append(s)
            self.eps[t].append(end)
        return start, end


class Automaton:
    """A pattern's lazy DFA over bytes. States are ints: 0 is dead (nothing can follow), `start` the initial
    state; `next(state, byte)` and `accepting(state)`. A state's transitions are made when first asked for."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise PatternError("a pattern must be a string")
        nfa = _NFA()
        try:
            entry, self._accept = nfa.build(_parse(pattern))
        except RecursionError:
            raise PatternError("the pattern nests its groups too deeply") from None
        self._nfa = nfa
        self._live = self._coreachable()
        self._sets: list[frozenset] = [frozenset()]
        self._ids: dict[frozenset, int] = {frozenset(): 0}
        # [states, 256] the transitions made so far (-1: not yet; a state's row is made whole), read by
        # `kestrel.grammar.tokens` in vectorized walks; the dead state's row leads to itself
        self.table = np.full((64, 256), -1, dtype=np.int64)
        self.table[0] = 0
        self.start = self._intern(self._closure({entry}))
        if self.start == 0:
            raise PatternError("the pattern matches nothing")

    @property
    def num_states(self) -> int:
        return len(self._sets)

    def accepting(self, state: int) -> bool:
        return self._accept in self._sets[state]

    def next(self, state: int, byte: int) -> int:
        nxt = int(self.table[state, byte])
        if nxt < 0:
            self.fill(state)
            nxt = int(self.table[state, byte])
        return nxt

    def fill(self, state: int) -> None:
        """All 256 transitions of a state at once: its bytes split into classes that every byte edge of its NFA
        states treats alike (a handful: a JSON string's state has about three), one closure a class. Made a
        byte at a time, a state inside a string took a closure for each of ~250 bytes. The row is written whole
        or not at all (a closure past MAX_STATE_SET raises first)."""
        nfa, row = self._nfa, np.zeros(256, dtype=np.int64)
        targets: dict[int, list[int]] = {}  # byte mask -> the NFA states its edges lead to
        for s in self._sets[state]:
            if nfa.edge_mask[s]:
                targets.setdefault(nfa.edge_mask[s], []).append(nfa.edge_to[s])
        classes = [(1 << 256) - 1]
        for m in targets:
            classes = [part for c in classes for part in (c & m, c & ~m) if part]
        for c in classes:
            byte = (c & -c).bit_length() - 1  # the class's lowest byte stands for it
            moved = {t for m, ts in targets.items() if m >> byte & 1 for t in ts}
            if moved:  # (the dead state 0 is the row's default)
                # the class's bytes from its 256-bit mask, unpacked by numpy (a Python loop over its bits took
                # most of a new state's time)
                bits = np.unpackbits(np.frombuffer(c.to_bytes(32, "little"), np.uint8), bitorder="little")
                row[bits == 1] = self._intern(self._closure(moved))
        self.table[state] = row

    def matches(self, data: bytes | str) -> bool:
        """Whole-string match (tests and checks; the sampler walks tokens through `next`)."""
        state = self.start
        for b in data.encode("utf-8") if isinstance(data, str) else data:
            state = self.next(state, b)
            if state == 0:
                return False
        return self.accepting(state)

    def _intern(self, states: frozenset) -> int:
        found = self._ids.get(states)
        if found is None:
            found = self._ids[states] = len(self._sets)
            self._sets.append(states)
            if found >= len(self.table):
                grown = np.full((2 * len(self.table), 256), -1, dtype=np.int64)
                grown[: len(self.table)] = self.table
                self.table = grown
        return found

    def _closure(self, states: set[int]) -> frozenset:
        """The states reachable through epsilon edges, keeping only those with a byte edge or the accept state
        (the others decide nothing) and only those from which the accept state is reachable."""
        nfa, live = self._nfa, self._live
        seen, todo = set(states), list(states)
        while todo:
            for t in nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        kept = frozenset(s for s in seen if live[s] and (nfa.edge_mask[s] or s == self._accept))
        if len(kept) > MAX_STATE_SET:
            raise PatternError(
                f"the pattern is too ambiguous to follow (one of its states holds {len(kept)} positions of the "
                f"pattern, past {MAX_STATE_SET}): repeats inside repeats that can split a text many ways, such as "
                "(?:[a-z]{1,200}){1,200}"
            )
        return kept

    def _coreachable(self) -> list[bool]:
        nfa = self._nfa
        back: list[list[int]] = [[] for _ in nfa.eps]
        for s, targets in enumerate(nfa.eps):
            for t in targets:
                back[t].append(s)
        for s, t in enumerate(nfa.edge_to):
            if t >= 0 and nfa.edge_mask[s]:
                back[t].append(s)
        live = [False] * len(nfa.eps)
        live[self._accept] = True
        todo = [self._accept]
        while todo:
            for s in back[todo.pop()]:
                if not live[s]:
                    live[s] = True
                    todo.append(s)
        return live
