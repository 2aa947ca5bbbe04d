r"""Patterns of numbers in a range, for JSON schemas' bounds (`kestrel.grammar.json_schema`): the canonical
decimals of the integers between two bounds, built digit by digit (13 to 457: `1[3-9]`, `[2-9]\d`, `[1-3]\d\d`,
`4[0-4]\d`, `45[0-7]`), and the exponent-free decimals between whole bounds."""

from __future__ import annotations

# Integers are written with at most this many digits: a bound past them narrows the range to them (a bound of
# 1e300 had nested a group a digit, which the automaton refuses, and past ~1,000 digits overflowed the stack)
MAX_DIGITS = 30


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """The canonical decimals (no leading zeros, no `-0`) of the integers in [lo, hi]; None: unbounded."""
    parts = []
    if lo is None or lo < 0:  # the negatives: "-" and a magnitude in [max(1, -hi), -lo]
        top = None if lo is None else -lo
        low = 1 if hi is None or hi >= 0 else -hi
        parts.append("-" + _magnitudes(low, top))
    if hi is None or hi >= 0:
        parts.append(_magnitudes(0 if lo is None else max(lo, 0), hi))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _magnitudes(lo: int, hi: int | None) -> str:
    """The canonical decimals of the integers in [lo, hi], 0 <= lo <= hi (None: unbounded)."""
    if hi is None:  # [lo, the last of its length], then any longer number
        n = len(str(lo))
        return "(?:" + _magnitudes(lo, 10**n - 1) + r"|[1-9]\d{" + str(n) + ",})"
    alts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):  # by length: each a same-length range
        first = max(lo, 10 ** (n - 1) if n > 1 else 0)
        alts.append(_same_length(str(first), str(min(hi, 10**n - 1))))
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def _same_length(x: str, y: str) -> str:
    """The digit strings of x's length from x to y (x <= y)."""
    if x == y:
        return x
    i = next(k for k in range(len(x)) if x[k] != y[k])
    prefix, x, y = x[:i], x[i:], y[i:]
    rest = len(x) - 1
    tail = r"\d" * rest if rest <= 2 else r"\d{" + str(rest) + "}"
    full_low, full_high = x[1:] == "0" * rest, y[1:] == "9" * rest
    a, b = int(x[0]), int(y[0])
    alts = []
    if not full_low:
        alts.append(x[0] + _same_length(x[1:], "9" * rest))
        a += 1
    if not full_high:
        b -= 1
    if a <= b:
        alts.append((str(a) if a == b else f"[{a}-{b}]") + tail)
    if not full_high:
        alts.append(y[0] + _same_length("0" * rest, y[1:]))
    return prefix + (alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")")


def decimal_range_regex(low: tuple[int, bool], high: tuple[int, bool] | None) -> str | None:
    """Non-negative decimals without an exponent (canonical integer part, any fraction) whose value m lies within
    low = (a, exclusive) and high = (b, exclusive) or None; None where none does."""
    (a, a_open), b = low, high
    alts = []
    first, last = a + a_open, None if b is None else b[0] - 1  # integer parts that take any fraction
    if last is None or first <= last:
        alts.append(_magnitudes(first, last) + r"(?:\.\d+)?")
    if a_open and (b is None or a < b[0]):  # a itself, above it by a fraction
        alts.append(str(a) + r"\.\d*[1-9]\d*")
    if b is not None and not b[1] and (b[0] > a or (b[0] == a and not a_open)):  # b itself, its fraction zero
        alts.append(str(b[0]) + r"(?:\.0+)?")
    if not alts:
        return None
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
