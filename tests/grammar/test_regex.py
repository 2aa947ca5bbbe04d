"""The byte-level automaton against Python's `re` (fullmatch) on random strings over an alphabet that mixes ASCII,
multi-byte characters and metacharacters; patterns it refuses name what and where."""

from __future__ import annotations

import random
import re

import pytest

from kestrel.grammar.regex import Automaton, PatternError, check_pattern

ALPHABET = list('abcdxyz19.-]{"\\ \n\x01') + ["é", "日", "😀"]

PATTERNS = [
    r"a|b*",
    r"(ab|c)+d?",
    r"[a-c]{2,3}x",
    r"\d+(\.\d+)?",
    r"[^a]*",
    r".é.",
    r"[é日]+",
    r"(?:x|y){0,2}z",
    r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"',
    r"^abc$",
    r"a{3}",
    r"a{2,}",
    r"[\d.]+",
    r"a.?b",
    r"(?P<n>a)b",
    r"[-a]",
    r"[a-]",
    r"[]a]",
    r"x{",
    r"a{1,2}?b",
    r"\D\S",
    r"(a|)+b",
    r"\u65e5|\x61",
    r"[\u00e0-\u00ff]+",
    r"\{\"[a-z]+\":\d\}",
    r"a{,3}",
    r"b{,}c",
]


def _strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(7))) for _ in range(n)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_as_python_re(pattern):
    automaton = Automaton(pattern)
    reference = re.compile(pattern, re.ASCII)
    strings = _strings(1500, seed=len(pattern))
    # the pattern's own matches, found by re, are in the sample too
    found = [s for s in strings if reference.fullmatch(s)]
    for s in strings:
        assert automaton.matches(s) == bool(reference.fullmatch(s)), (pattern, s)
    assert automaton.matches(b"\xff") is False  # not UTF-8: never a match
    if pattern in (r"[^a]*", r"a|b*"):
        assert found  # the sample does hold matches


def test_states_are_made_when_reached():
    """A large pattern's automaton starts with the states its first steps need, not its whole DFA."""
    automaton = Automaton("(?:" + "|".join(f"key{i}:[a-z]{{1,40}}" for i in range(200)) + ")")
    before = automaton.num_states
    assert before < 10
    assert automaton.matches("key17:abc")
    # (a state's transitions are made together, so its neighbours too; the whole DFA has over 8,000 states)
    assert automaton.num_states < before + 60


def test_dead_state_is_zero_and_stays():
    a = Automaton("ab")
    s = a.next(a.start, ord("x"))
    assert s == 0 and a.next(s, ord("a")) == 0 and not a.accepting(0)


@pytest.mark.parametrize(
    "pattern, says",
    [
        ("a^b", "anchor"),
        ("(?=a)", "lookaround"),
        ("(?<!a)b", "lookaround"),
        ("(?i)a", "inline flags"),
        (r"(a)\1", "escape"),
        (r"\bword", "escape"),
        ("a**", "multiple repeat"),
        ("a++", "possessive"),
        ("(a", "missing ')'"),
        ("a)", "unbalanced"),
        ("[a", "unterminated"),
        ("[^é]", "negated class"),
        ("*a", "nothing to repeat"),
        ("a{3,1}", "maximum below"),
        (r"\x4", "hex digits"),
        ("[z-a]", "bad range"),
        ("[\u0100-\uffff]", "non-ASCII"),
        ("\\", "cannot end"),
    ],
)
def test_refused_patterns_say_why(pattern, says):
    with pytest.raises(PatternError, match=re.escape(says)):
        check_pattern(pattern)
    with pytest.raises(PatternError, match="position"):
        Automaton(pattern)


def test_deep_nesting_is_a_pattern_error_not_a_recursion_error():
    with pytest.raises(PatternError, match="too deeply"):
        check_pattern("(" * 400 + "a" + ")" * 400)
    with pytest.raises(PatternError, match="too deeply"):
        Automaton("(" * 400 + "a" + ")" * 400)


def test_a_pattern_too_ambiguous_to_follow_is_refused_when_reached():
    """Overlapping repeats inside repeats make states of tens of thousands of NFA states (seconds a token):
    past MAX_STATE_SET a state is refused."""
    a = Automaton("(?:[a-z]{1,200}){1,200}")
    state = a.start
    with pytest.raises(PatternError, match="too ambiguous"):
        for _ in range(200):
            state = a.next(state, ord("a"))


def test_a_pattern_too_large_is_refused():
    with pytest.raises(PatternError, match="too large"):
        Automaton("(?:[a-z]{1000}){1000}")
