"""The `kestrel` command line's argument types: each turns a string into a value or raises
argparse.ArgumentTypeError with one line that names what was expected and what came (argparse prefixes the
option)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from kestrel.engine.sampling_params import INT32_MAX


def int_at_least(text: str, low: int, what: str, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return int_at_least(text, 0, "an integer >= 0")


def share(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a share between 0 and 1, got {value}")
    return value


def int_range(text: str) -> tuple[int, int]:
    """`LO,HI` (or one number N for N,N): two positive integers, LO <= HI."""
    parts = text.split(",")
    if len(parts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}")
    lo, hi = (positive_int(p.strip()) for p in (parts * 2)[:2])
    if lo > hi:
        raise argparse.ArgumentTypeError(f"expected LO <= HI, got {text!r}")
    return lo, hi


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return value


def seed(text: str) -> int:
    """A seed: an integer in int64 (a larger one overflowed in torch's generator, a traceback)."""
    return int_at_least(text, -(2**63), "an integer in [-2**63, 2**63 - 1]", high=2**63 - 1)


def positive_share(text: str) -> float:
    """A number in (0, 1]: --top-p (0 would keep no token) and --mem-fraction (no KV pages)."""
    value = share(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number in (0, 1], got 0.0")
    return value


def top_k(text: str) -> int:
    """top-k: 0 or -1 for off, else how many tokens to keep (at most int32's largest, as SamplingParams)."""
    value = int_at_least(text, -1, f"an integer in [-1, {INT32_MAX}] (0 or -1 = off)", high=INT32_MAX)
    return max(value, 0)


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [1, 65535], got {value}")
    return value


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def api_key(text: str) -> str:
    """An API key: an empty one (an unset environment variable) would have turned the check off unseen."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty key; leave --api-key out to serve without one")
    return text


def origin(text: str) -> str:
    """A browser origin for CORS, `scheme://host[:port]` as browsers send it, or `*`: one with a path or a trailing
    slash never equals what a browser sends, so its pages would be refused without a word."""
    if text == "*":
        return text
    m = re.fullmatch(r"(https?)://([^/?#\s]+)", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an origin: scheme://host[:port] with no path or trailing slash "
            "(e.g. http://localhost:3000), or * for any"
        )
    return text


FIELD_NAMES = r"\b[a-z]+(?:_[a-z]+)+\b"  # snake_case words: a config's field names in its messages


def as_flags(message: str, args, dest: Callable[[str], str | None] = str, pattern: str = FIELD_NAMES) -> str:
    """A config's error message in the flags the user gave: each field name (`pattern`'s matches) whose `dest` (the
    parsed argument that sets it; None: none) `args` has becomes its flag, `row_len` `--row-len`; other words stay."""

    def flag(match: re.Match) -> str:
        name = dest(match[0])
        return "--" + name.replace("_", "-") if name is not None and hasattr(args, name) else match[0]

    return re.sub(pattern, flag, message)


def path(text: str) -> Path:
    """A path to write to: an empty one (an unset environment variable) was the current folder, where a
    checkpoint, a training run or a result landed unasked."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder name")
    return Path(text)
