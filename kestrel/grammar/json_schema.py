"""JSON schemas as regex patterns, for structured outputs (OpenAI `response_format`, vLLM `structured_outputs`).

`schema_to_regex` turns a JSON schema into a pattern for the grammar module's regex compiler, which builds the
byte-level automaton that masks tokens while decoding. The pattern matches the whole output (as `re.fullmatch`)
and uses a strict subset of Python's `re` syntax: literals, escapes (`\\xHH`, `\\uHHHH`, `\\d`, an escaped
metacharacter), classes, non-capturing groups, alternation and greedy quantifiers; no anchors, lookaround,
backreferences or flags.

Output form: compact JSON, with no whitespace between tokens (as `json.dumps(x, separators=(",", ":"),
ensure_ascii=False)` writes it, though strings may hold any JSON escape), and an object's properties in the
order of the schema's `properties`. Every output is an instance of the schema; the converter narrows the
schema where a regex cannot follow it (property order, no undeclared properties), never widens it.

Supported:
- `true` / `{}`: any JSON value, containers nested at most `max_depth` deep.
- `type` (one name or a list), `enum`, `const`. Without `type`, the type is inferred from the keywords present
  (`properties` means an object, `items` an array, `minLength` a string...), or any value if none is.
  An `enum`/`const` value is kept only if it also satisfies the schema's other keywords.
- `anyOf`; `oneOf`, treated as `anyOf` (branches are not checked to be exclusive); `allOf` of exactly one
  subschema.
- `$ref` to `#`, `#/$defs/NAME` or `#/definitions/NAME`. A recursive definition is expanded at most
  `max_depth` times inside itself; a branch that would need more produces no alternative.
- object: `properties`, `required`, `additionalProperties`. The output holds only the declared properties,
  which is valid whether `additionalProperties` is false, true or a schema. An object that declares no
  properties is `{}` when `additionalProperties` is false, a map of its schema when it is one, and any
  object (values nested at most `max_depth` - 1 deep) otherwise.
- array: `items` (a schema or a boolean; absent means any value nested at most `max_depth` - 1 deep, as for an
  object), `prefixItems`, `minItems`, `maxItems`.
- string: `minLength`, `maxLength` (in characters, an escape counting as one: a surrogate pair written as two
  `\\uXXXX` escapes counts as two), `pattern`, `format` date, time, date-time (RFC 3339, upper-case `T` and
  `Z`, time with its offset), uuid, email (a simple local@domain.tld form), uri (a scheme, then RFC 3986's
  characters).
  A `pattern` is anchored (one leading `^` and trailing `$` are stripped; JSON Schema would search, and a
  full match is one of the strings a search accepts) and translated to the JSON text of the strings it
  matches: `"` and `\\` are written escaped, classes and `.` lose the characters JSON must escape, `\\d` and
  `\\w` are ASCII (as in JSON Schema's ECMA-262 regexes), groups become non-capturing and lazy quantifiers
  greedy. Anchors inside it, lookaround, backreferences, inline flags and word boundaries are refused.
- integer and number, with `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (as pydantic's `ge`, `le`,
  `gt`, `lt` write them): an integer's canonical decimals in its range (`-0` is not written; at most 30 digits,
  a wider range narrowed to them); a bounded number is written without an exponent (`0.5`, never `5e-1`), its
  bounds whole numbers (`ge=0, le=1`), its integer part at most 30 digits. A type (or an anyOf branch) whose
  bounds no number meets leaves the others (`["integer", "null"]`).
- boolean, null.
- Annotations are ignored: title, description, default, examples, $schema, $id, $comment, deprecated,
  readOnly, writeOnly, discriminator (an OpenAPI hint pydantic emits), `$defs`/`definitions` (read only
  through `$ref`), and `format` on a type other than string.

`max_depth` (default 4) bounds both the nesting of unconstrained values and recursion. An unconstrained
value's pattern grows about fourfold per level of nesting (arrays and objects each spell their item twice):
about 13 KB at depth 3, 53 KB at depth 4; `json_object_regex()` (depth 5, the object included) is about 107 KB.
Objects stay linear in their number of properties, optional ones included.

Refused with `SchemaError`, whose message starts with the JSON pointer of the part at fault: the schema
`false`, a number's fractional bounds, bounds without a numeric type, `multipleOf`, draft 4's boolean exclusive
bounds, any other
keyword (`not`, `if`, `patternProperties`, `uniqueItems`, `minProperties`, `contains`...), other formats,
other `$ref`s, `allOf` of several subschemas, a combinator (`$ref`, `anyOf`, `oneOf`, `allOf`) beside
constraint keywords, `pattern` or `format` beside a length bound, and malformed schemas.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import NoReturn
from urllib.parse import unquote

from kestrel.grammar.numbers import MAX_DIGITS, decimal_range_regex, integer_range_regex

__all__ = [
    "SchemaError",
    "choice_regex",
    "escape",
    "integer_range_regex",
    "json_object_regex",
    "schema_to_regex",
]

DEFAULT_MAX_DEPTH = 4

# One character of a JSON string's text: an unescaped one, or an escape (which decodes to one character).
_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))'
_STRING = '"' + _CHAR + '*"'
_INTEGER = r"-?(?:0|[1-9]\d*)"
_NUMBER = _INTEGER + r"(?:\.\d+)?(?:[eE][+-]?\d+)?"
_BOOLEAN = "(?:true|false)"
_SCALARS = f"{_STRING}|{_NUMBER}|true|false|null"

_DATE = r"\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])"
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_HEX = "[0-9a-fA-F]"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": r"[A-Za-z0-9_%+\-]+(?:\.[A-Za-z0-9_%+\-]+)*@(?:[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?\.)+"
    r"[A-Za-z]{2,}",
    # RFC 3986: a scheme, then the characters a URI may hold (a tool's `url` argument, as Claude Code's are)
    "uri": r"[A-Za-z][A-Za-z0-9+.\-]*:[A-Za-z0-9\-._~:/?#\x5b\]@!$&'()*+,;=%]*",
}

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",
        "$defs",
        "definitions",
    }
)
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_KEYWORDS = _ANNOTATIONS | {
    "type",
    "enum",
    "const",
    *_COMBINATORS,
    *_OBJECT_KEYWORDS,
    *_ARRAY_KEYWORDS,
    *_STRING_KEYWORDS,
}
_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")

_META = frozenset("\\.^$*+?()[]{}|")


def _numeric(types) -> bool:
    """A schema's `type` admits numbers (where its bounds apply)."""
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    return "integer" in names or "number" in names


def _narrowed(lo: int | None, hi: int | None, path: str) -> tuple[int | None, int | None]:
    """Integer bounds narrowed to the integers of at most MAX_DIGITS digits (a SchemaError where none is left):
    a lower bound only rises, an upper one only falls."""
    top = 10**MAX_DIGITS - 1
    if (lo is not None and lo > top) or (hi is not None and hi < -top):
        raise SchemaError(f"{path}: its numbers all have more than {MAX_DIGITS} digits before the point")
    return (None if lo is None else max(lo, -top)), (None if hi is None else min(hi, top))


class SchemaError(ValueError):
    """A schema the converter cannot honour; the message names the JSON pointer of the part at fault, e.g.
    "#/properties/age: unsupported keyword 'multipleOf'"."""


class _NoNumber(SchemaError):
    """Numeric bounds that no number of the type meets."""


def _alt_of(makers) -> str | None:
    """`_alt` of the options the makers make, leaving out those whose bounds no number meets (a type of several,
    an anyOf branch: the others may still have values); the last such error where every one is left out."""
    found, empty = [], None
    for make in makers:
        try:
            found.append(make())
        except _NoNumber as e:
            empty = e
    if not found:
        raise empty
    return _alt(found)


def schema_to_regex(schema: dict | bool, max_depth: int = DEFAULT_MAX_DEPTH) -> str:
    """A pattern matching the compact JSON instances of `schema` (see the module docstring). `max_depth`
    bounds the nesting of containers inside unconstrained values and the expansions of a recursive `$ref`."""
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be a non-negative integer, got {max_depth!r}")
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"#: a schema must be an object or a boolean, got {type(schema).__name__}")
    rx = _Converter(schema, max_depth).value(schema, "#")
    if rx is None:
        raise SchemaError(
            f"#: no instance fits within max_depth={max_depth} (a recursion without a way out?)"
        )
    return rx


def json_object_regex(max_depth: int = 5) -> str:
    """Any JSON object (OpenAI's `json_object` response format), with at most `max_depth` levels of
    containers counting the object itself."""
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive integer, got {max_depth!r}")
    return _map_of(_any_value(max_depth - 1))


def choice_regex(choices: list[str]) -> str:
    """Exactly one of `choices`, each taken literally (vLLM's guided choice)."""
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choices must be a non-empty list of strings")
    return _alt([escape(c) for c in choices])


def escape(text: str) -> str:
    """A pattern matching exactly `text`."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _META:
            out.append("\\" + ch)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF and not ch.isprintable():  # invisible characters, spelled out for readability
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


# --- pattern building ------------------------------------------------------------------------------------
# A fragment is a pattern string, or None for "no alternative" (a recursion cut at max_depth). No fragment has
# a top-level `|`, so fragments concatenate safely.


def _alt(options) -> str | None:
    opts = list(dict.fromkeys(o for o in options if o is not None))
    if not opts:
        return None
    nonempty = [o for o in opts if o]
    if not nonempty:
        return ""
    body = nonempty[0] if len(nonempty) == 1 else "(?:" + "|".join(nonempty) + ")"
    return _repeat(body, 0, 1) if len(nonempty) < len(opts) else body


def _repeat(rx: str, lo: int, hi: int | None) -> str:
    """`rx` repeated lo..hi times (hi None: unbounded)."""
    if hi == 0 or not rx:
        return ""
    if lo == hi == 1:
        return rx
    if (lo, hi) == (0, None):
        q = "*"
    elif (lo, hi) == (1, None):
        q = "+"
    elif (lo, hi) == (0, 1):
        q = "?"
    elif lo == hi:
        q = f"{{{lo}}}"
    elif hi is None:
        q = f"{{{lo},}}"
    else:
        q = f"{{{lo},{hi}}}"
    return (rx if _atom_end(rx, 0) == len(rx) else f"(?:{rx})") + q


def _atom_end(rx: str, i: int) -> int:
    """The end of the atom (escape, class, group or character) starting at rx[i]."""
    c = rx[i]
    if c == "\\":
        return i + {"x": 4, "u": 6}.get(rx[i + 1], 2)
    if c == "[":
        j = i + 1
        j += rx.startswith("^", j)
        j += rx.startswith("]", j)  # a `]` first in a class is a literal
        while rx[j] != "]":
            j += 2 if rx[j] == "\\" else 1
        return j + 1
    if c == "(":
        depth, j = 0, i
        while True:
            if rx[j] in "\\[":
                j = _atom_end(rx, j)
                continue
            depth += {"(": 1, ")": -1}.get(rx[j], 0)
            j += 1
            if depth == 0:
                return j
    return i + 1


def _seq(*parts: str | None) -> str | None:
    return None if any(p is None for p in parts) else "".join(parts)


def _list_of(item: str | None, lo: int, hi: int | None, sep: str = ",") -> str | None:
    """lo..hi items separated by commas."""
    if lo == 0 and (hi == 0 or item is None):
        return ""
    if item is None:
        return None
    rest = _repeat(sep + item, max(lo - 1, 0), None if hi is None else hi - 1)
    return item + rest if lo > 0 else _repeat(item + rest, 0, 1)


def _map_of(value: str | None) -> str:
    return r"\{" + _list_of(_seq(_STRING, ":", value), 0, None) + r"\}"


@functools.cache
def _any_value(depth: int) -> str | None:
    """Any JSON value with at most `depth` levels of containers (None below zero)."""
    if depth < 0:
        return None
    if depth == 0:
        return f"(?:{_SCALARS})"
    inner = _any_value(depth - 1)
    array = r"\[" + _list_of(inner, 0, None) + r"\]"
    return f"(?:{_SCALARS}|{array}|{_map_of(inner)})"


def _members(entries: list[tuple[str, bool]]) -> str:
    """An object's members, each (pattern of `"key":value`, required), in order with commas between.

    Built left to right: `written` matches the non-empty runs of the members so far (None: none yet), and
    each member is either appended to one (after a comma) or, while nothing required came before, starts
    one. Every member appears at most twice, so the pattern stays linear in the number of optional members,
    where listing their subsets would be exponential."""
    written, may_be_empty = None, True
    for member, required in entries:
        if written is None:
            written = member
        elif required and may_be_empty:
            written = _repeat(written + ",", 0, 1) + member
        elif required:
            written = written + "," + member
        else:
            continued = written + _repeat("," + member, 0, 1)
            written = _alt([continued, member]) if may_be_empty else continued
        may_be_empty = may_be_empty and not required
    if written is None:
        return ""
    return _repeat(written, 0, 1) if may_be_empty else written


# --- a schema's `pattern` ---------------------------------------------------------------------------------
# The pattern constrains the decoded string, the output regex its JSON text: the translation keeps every
# character a JSON string may hold unescaped, writes `"` and `\` as their JSON escapes, and drops from classes
# (and `.`) the characters that would need escaping. Shorthands take their JSON Schema (ECMA-262) meaning:
# `\d` and `\w` are ASCII. It also rewrites what the dialect lacks: groups become non-capturing, lazy
# quantifiers greedy (the same language), a brace that is no quantifier a literal.

_JSON_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # must be escaped inside a JSON string
_SHORTHANDS = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029))
    + ((0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)),
}
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07}
_JSON_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_QUANTIFIER = re.compile(r"\{(\d*)(,?)(\d*)\}")


def _normalize(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _subtract(ranges, removed) -> list[tuple[int, int]]:
    out = []
    for lo, hi in _normalize(ranges):
        for r_lo, r_hi in _normalize(removed):
            if r_hi < lo or r_lo > hi:
                continue
            if r_lo > lo:
                out.append((lo, r_lo - 1))
            lo = r_hi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return out


def _class_char(code: int) -> str:
    ch = chr(code)
    if ch in "\\]-":
        return "\\" + ch
    if code < 0x20 or code == 0x7F or ch in "^[":  # the dialect escapes only `\\`, `]` and `-` by name
        return f"\\x{code:02x}"
    if code <= 0xFFFF and not ch.isprintable():
        return f"\\u{code:04x}"
    return ch


def _char_class(ranges, negated: bool = False) -> str:
    body = "".join(
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in ranges
    )
    return ("[^" if negated else "[") + body + "]"


def _json_char(code: int) -> str:
    """The JSON text of one character of a string's value (in one spelling when there are several)."""
    if code in _JSON_SHORT_ESCAPES:  # grouped: a quantifier may follow
        return r"(?:\\" + escape(_JSON_SHORT_ESCAPES[code]) + ")"
    if code < 0x20:
        return rf"(?:\\u{code:04x})"
    return escape(chr(code))


class _PatternTranslator:
    def __init__(self, pattern: str, path: str):
        self.src, self.path, self.i = pattern, path, 0

    def fail(self, what: str) -> NoReturn:
        raise SchemaError(f"{self.path}: {what} at offset {self.i} of {self.src!r} is unsupported")

    def translate(self) -> str:
        src, out = self.src, []
        while self.i < len(src):
            c = src[self.i]
            if c == "(":
                out.append(self.group_open())
            elif c in ")|":
                out.append(c)
                self.i += 1
            elif c in "*+?{":
                out.append(self.quantifier())
            elif c in "^$":
                self.fail("an anchor inside the pattern")
            elif c == ".":
                out.append(_char_class(_normalize(((0x0A, 0x0A), *_JSON_UNSAFE)), negated=True))
                self.i += 1
            elif c == "[":
                out.append(self.char_class())
            elif c == "\\":
                out.append(self.escape_outside())
            else:
                out.append(_json_char(ord(c)))
                self.i += 1
        return "(?:" + "".join(out) + ")" if out else ""

    def group_open(self) -> str:
        src, i = self.src, self.i
        if src.startswith("(?:", i):
            self.i += 3
        elif src.startswith("(?P<", i):
            self.i = src.index(">", i) + 1
        elif src.startswith("(?", i):
            self.fail("a group of kind " + repr(src[i : i + 3]))
        else:
            self.i += 1
        return "(?:"

    def quantifier(self) -> str:
        src, c = self.src, self.src[self.i]
        q = c
        if c == "{":
            m = _QUANTIFIER.match(src, self.i)
            if not m or not (m[2] or m[1]):  # not a quantifier: a literal brace
                self.i += 1
                return r"\{"
            q = "{" + (m[1] or "0") + m[2] + m[3] + "}"
            self.i = m.end()
        else:
            self.i += 1
        if src.startswith("?", self.i):  # lazy: the same language as greedy
            self.i += 1
        elif src.startswith("+", self.i):
            self.fail("a possessive quantifier")
        return q

    def escape_code(self) -> int | str:
        """The escape at src[i]: a code point, or a shorthand's letter."""
        src, i = self.src, self.i
        letter = src[i + 1]
        widths = {"x": 2, "u": 4, "U": 8}
        if letter in widths:
            self.i = i + 2 + widths[letter]
            return int(src[i + 2 : self.i], 16)
        if letter.isalnum() and letter not in _CHAR_ESCAPES and letter.lower() not in _SHORTHANDS:
            self.fail(f"the escape \\{letter}")
        self.i = i + 2
        return _CHAR_ESCAPES.get(letter, letter if letter.lower() in _SHORTHANDS else ord(letter))

    def escape_outside(self) -> str:
        code = self.escape_code()
        if code == "d":
            return r"\d"
        if isinstance(code, str):
            ranges = _SHORTHANDS[code.lower()]
            if code.islower():
                return _char_class(_subtract(ranges, _JSON_UNSAFE))
            return _char_class(_normalize(ranges + _JSON_UNSAFE), negated=True)
        return _json_char(code)

    def char_class(self) -> str:
        src = self.src
        self.i += 1
        negated = src.startswith("^", self.i)
        self.i += negated
        ranges, first = [], True
        while first or src[self.i] != "]":
            first = False
            lo = self.class_member()
            if isinstance(lo, tuple):
                ranges.extend(lo)
            elif src[self.i] == "-" and src[self.i + 1] != "]":
                self.i += 1
                hi = self.class_member()
                if isinstance(hi, tuple):
                    self.fail("a range ending in a shorthand")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        self.i += 1
        if negated:
            return _char_class(_normalize(ranges + list(_JSON_UNSAFE)), negated=True)
        kept = _subtract(ranges, _JSON_UNSAFE)
        if not kept:
            self.fail("a class of characters that all need escaping")
        return _char_class(kept)

    def class_member(self) -> int | tuple:
        if self.src[self.i] != "\\":
            self.i += 1
            return ord(self.src[self.i - 1])
        if self.src[self.i + 1] == "b":  # a backspace inside a class
            self.i += 2
            return 0x08
        code = self.escape_code()
        if isinstance(code, str):
            if code.isupper():
                self.fail(f"the negated shorthand \\{code} inside a class")
            return _SHORTHANDS[code]
        return code


def _user_pattern(pattern, path: str) -> str:
    """A schema's `pattern`, anchored (one leading `^` and trailing `$` stripped), as a dialect pattern."""
    if not isinstance(pattern, str):
        raise SchemaError(f"{path}: must be a string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise SchemaError(f"{path}: invalid regex {pattern!r} ({e})") from None
    if pattern.startswith("^"):
        pattern = pattern[1:]
    trailing_backslashes = len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))
    if pattern.endswith("$") and trailing_backslashes % 2 == 0:
        pattern = pattern[:-1]
    return _PatternTranslator(pattern, path).translate()


# --- schema walking --------------------------------------------------------------------------------------


def _pointer(path: str, *tokens) -> str:
    return "/".join([path] + [str(t).replace("~", "~0").replace("/", "~1") for t in tokens])


def _compact(value, path: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"{path}: {value!r} is not a JSON value ({e})") from None


def _count(schema: dict, key: str, path: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{_pointer(path, key)}: must be a non-negative integer, got {value!r}")
    return value


def _bounds(schema: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
    lo, hi = _count(schema, lo_key, path) or 0, _count(schema, hi_key, path)
    if hi is not None and lo > hi:
        raise SchemaError(f"{path}: {lo_key} {lo} is greater than {hi_key} {hi}")
    return lo, hi


class _Converter:
    def __init__(self, root: dict | bool, max_depth: int):
        self.root = root
        self.max_depth = max_depth
        self.active_refs = ["#"]  # the $ref targets being expanded, outermost first; the root is one

    def value(self, schema, path: str) -> str | None:
        if schema is True:
            return _any_value(self.max_depth)
        if schema is False:
            raise SchemaError(f"{path}: the schema false accepts no value")
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: a schema must be an object or a boolean, got {type(schema).__name__}")
        self._check_keywords(schema, path)
        if "enum" in schema or "const" in schema:
            return self._literals(schema, path)
        for key in _COMBINATORS:
            if key in schema:
                return self._combinator(key, schema, path)
        types = self._types(schema, path)
        if types is None:
            return _any_value(self.max_depth)
        return _alt_of(lambda t=t: getattr(self, "_" + t)(schema, path) for t in types)

    def _check_keywords(self, schema: dict, path: str) -> None:
        for key in schema:
            if key == "multipleOf":
                raise SchemaError(f"{path}: unsupported keyword {key!r} (multipleOf is not supported)")
            if key in _BOUNDS and not _numeric(schema.get("type")):
                raise SchemaError(f"{path}: {key!r} needs a type integer or number beside it")
            if key not in _KEYWORDS and key not in _BOUNDS:
                raise SchemaError(f"{path}: unsupported keyword {key!r}")
        combinators = [k for k in _COMBINATORS if k in schema]
        if combinators and "enum" not in schema and "const" not in schema:
            siblings = [k for k in schema if k not in _ANNOTATIONS and k != "format" and k != combinators[0]]
            if siblings:
                raise SchemaError(f"{path}: {combinators[0]!r} cannot be combined with {siblings[0]!r}")

    def _types(self, schema: dict, path: str) -> list[str] | None:
        if "type" not in schema:
            families = [
                ("object", _OBJECT_KEYWORDS),
                ("array", _ARRAY_KEYWORDS),
                ("string", _STRING_KEYWORDS),
            ]
            inferred = [name for name, keys in families if any(k in schema for k in keys)]
            return inferred or None
        types = schema["type"]
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not names or not all(isinstance(t, str) for t in names):
            raise SchemaError(f"{path}/type: must be a type name or a non-empty list of them, got {types!r}")
        for name in names:
            if name not in _TYPES:
                raise SchemaError(f"{path}/type: unknown type {name!r}")
        if "number" in names:  # a number pattern already matches every integer
            names = [t for t in names if t != "integer"]
        return list(dict.fromkeys(names))

    def _literals(self, schema: dict, path: str) -> str | None:
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}/enum: must be a non-empty list, got {values!r}")
            texts = [_compact(v, _pointer(path, "enum", i)) for i, v in enumerate(values)]
        if "const" in schema:
            const = _compact(schema["const"], _pointer(path, "const"))
            if "enum" in schema and const not in texts:
                raise SchemaError(f"{path}: const {const} is not one of enum's values")
            texts = [const]
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const") and k not in _ANNOTATIONS}
        if rest:
            # A literal must satisfy the sibling keywords too: test it against their own pattern.
            rest_rx = self.value(rest, path)
            if rest_rx is None:
                return None
            checker = re.compile(rest_rx)
            texts = [t for t in texts if checker.fullmatch(t)]
            if not texts:
                raise SchemaError(f"{path}: no enum/const value satisfies the schema's other keywords")
        return _alt(escape(t) for t in texts)

    def _combinator(self, key: str, schema: dict, path: str) -> str | None:
        arg = schema[key]
        if key == "$ref":
            return self._ref(arg, path)
        if not isinstance(arg, list) or not arg:
            raise SchemaError(f"{path}/{key}: must be a non-empty list of schemas")
        if key == "allOf" and len(arg) != 1:
            raise SchemaError(f"{path}/allOf: only an allOf of exactly one subschema is supported")
        return _alt_of(
            lambda i=i, sub=sub: self.value(sub, _pointer(path, key, i)) for i, sub in enumerate(arg)
        )

    def _ref(self, ref, path: str) -> str | None:
        if not isinstance(ref, str):
            raise SchemaError(f"{path}/$ref: must be a string, got {ref!r}")
        target, target_path = self._resolve(ref, path)
        if self.active_refs.count(target_path) > self.max_depth:
            return None
        self.active_refs.append(target_path)
        try:
            return self.value(target, target_path)
        finally:
            self.active_refs.pop()

    def _resolve(self, ref: str, path: str):
        if ref == "#":
            return self.root, "#"
        for container in ("$defs", "definitions"):
            prefix = f"#/{container}/"
            if ref.startswith(prefix) and "/" not in ref[len(prefix) :]:
                name = unquote(ref[len(prefix) :]).replace("~1", "/").replace("~0", "~")
                defs = self.root.get(container) if isinstance(self.root, dict) else None
                if not isinstance(defs, dict) or name not in defs:
                    raise SchemaError(f"{path}/$ref: unresolvable reference {ref!r}")
                return defs[name], _pointer("#", container, name)
        raise SchemaError(
            f"{path}/$ref: unsupported reference {ref!r} (only #, #/$defs/NAME, #/definitions/NAME)"
        )

    # --- one method per type, named after it ---

    def _string(self, schema: dict, path: str) -> str:
        lo, hi = _bounds(schema, "minLength", "maxLength", path)
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is not None and fmt is not None:
            raise SchemaError(f"{path}: pattern cannot be combined with format")
        if (pattern is not None or fmt is not None) and ("minLength" in schema or "maxLength" in schema):
            raise SchemaError(f"{path}: minLength/maxLength cannot be combined with pattern or format")
        if pattern is not None:
            return '"' + _user_pattern(pattern, path + "/pattern") + '"'
        if fmt is not None:
            if fmt not in _FORMATS:
                raise SchemaError(
                    f"{path}/format: unsupported format {fmt!r} (supported: {', '.join(_FORMATS)})"
                )
            return '"' + _FORMATS[fmt] + '"'
        return '"' + _repeat(_CHAR, lo, hi) + '"'

    def _bounds(self, schema: dict, path: str) -> dict:
        """The schema's numeric bounds by keyword (finite numbers; an infinite one is no bound)."""
        found = {}
        for key in _BOUNDS:
            if key in schema:
                value = schema[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                    raise SchemaError(f"{_pointer(path, key)}: must be a number, got {value!r}")
                if abs(value) != float("inf"):
                    found[key] = value
        return found

    def _tightest(self, bounds: dict) -> tuple[tuple | None, tuple | None]:
        """The tightest lower and upper bound, each (value, exclusive) or None: the greater lower one, the smaller
        upper one, an exclusive one where they tie."""
        lower = upper = None
        for key, value in bounds.items():
            bound = (value, key.startswith("exclusive"))
            if key.endswith("inimum"):
                lower = bound if lower is None or bound > lower else lower
            elif upper is None or (-bound[0], bound[1]) > (-upper[0], upper[1]):
                upper = bound
        return lower, upper

    def _integer(self, schema: dict, path: str) -> str:
        bounds = self._bounds(schema, path)
        if not bounds:
            return _INTEGER
        lower, upper = self._tightest(bounds)
        # the least and the greatest integer allowed (None: unbounded)
        lo = None if lower is None else math.floor(lower[0]) + 1 if lower[1] else math.ceil(lower[0])
        hi = None if upper is None else math.ceil(upper[0]) - 1 if upper[1] else math.floor(upper[0])
        if lo is not None and hi is not None and lo > hi:
            raise _NoNumber(f"{path}: no integer lies within its bounds")
        return integer_range_regex(*_narrowed(lo, hi, path))

    def _number(self, schema: dict, path: str) -> str:
        bounds = self._bounds(schema, path)
        if not bounds:
            return _NUMBER
        for key, value in bounds.items():
            if value != int(value):
                raise SchemaError(
                    f"{_pointer(path, key)}: a number's bound must be a whole number here, got {value!r}"
                )
        lower, upper = self._tightest({key: int(value) for key, value in bounds.items()})
        lo, hi = _narrowed(lower and lower[0], upper and upper[0], path)
        if lower is not None and lo != lower[0]:
            lower = (lo, False)
        if upper is not None and hi != upper[0]:
            upper = (hi, False)
        parts = []
        # x >= 0: its magnitude within [max(lower, 0), upper]
        if upper is None or upper[0] > 0 or (upper[0] == 0 and not upper[1]):
            low = lower if lower is not None and lower[0] >= 0 else (0, False)
            parts.append(decimal_range_regex(low, upper))
        # x < 0: "-" and a magnitude m > 0 with lower <= -m <= upper
        if lower is None or lower[0] < 0:
            low = (-upper[0], upper[1]) if upper is not None and upper[0] < 0 else (0, True)
            high = None if lower is None else (-lower[0], lower[1])
            magnitude = decimal_range_regex(low, high)
            parts.append(None if magnitude is None else "-" + magnitude)
        parts = [p for p in parts if p is not None]
        if not parts:
            raise _NoNumber(f"{path}: no number lies within its bounds")
        return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"

    def _boolean(self, schema: dict, path: str) -> str:
        return _BOOLEAN

    def _null(self, schema: dict, path: str) -> str:
        return "null"

    def _object(self, schema: dict, path: str) -> str | None:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{path}/properties: must be an object, got {props!r}")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}/required: must be a list of strings, got {required!r}")
        for name in required:
            if name not in props:
                raise SchemaError(
                    f"{path}/required: required property {name!r} is not declared in properties"
                )
        additional = schema.get("additionalProperties", True)
        if not isinstance(additional, (bool, dict)):
            raise SchemaError(
                f"{path}/additionalProperties: must be a boolean or a schema, got {additional!r}"
            )
        if not props:
            if additional is False:
                return r"\{\}"
            if additional is True:
                return _map_of(_any_value(self.max_depth - 1))
            return _map_of(self.value(additional, path + "/additionalProperties"))
        entries = []
        for name, sub in props.items():
            value = self.value(sub, _pointer(path, "properties", name))
            if value is None:
                if name in required:
                    return None
                continue  # a recursion cut short: the property is left out
            entries.append((escape(_compact(name, path)) + ":" + value, name in required))
        return r"\{" + _members(entries) + r"\}"

    def _array(self, schema: dict, path: str) -> str | None:
        lo, hi = _bounds(schema, "minItems", "maxItems", path)
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError(f"{path}/prefixItems: must be a list of schemas, got {prefix!r}")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise SchemaError(
                f"{path}/items: a list of schemas (the old tuple form) is unsupported; use prefixItems"
            )
        prefix_rx = [self.value(sub, _pointer(path, "prefixItems", i)) for i, sub in enumerate(prefix)]
        if "items" not in schema:  # an unconstrained array nests as deep as an unconstrained object
            item_rx = _any_value(self.max_depth - 1)
        else:
            item_rx = None if items is False else self.value(items, path + "/items")
        return self._elements(prefix_rx, item_rx, lo, hi)

    def _elements(self, prefix: list[str | None], item: str | None, lo: int, hi: int | None) -> str | None:
        """`[...]` of lo..hi elements: the first ones from `prefix` in order, any further ones `item`."""
        if None in prefix:  # a prefix item with no alternative: the array must end before it
            prefix, item = prefix[: prefix.index(None)], None
        if hi is not None and hi <= len(prefix):
            prefix, item = prefix[:hi], None
        if item is None:
            hi = len(prefix)
        if hi is not None and lo > hi:
            return None
        if not prefix:
            return _seq(r"\[", _list_of(item, lo, hi), r"\]")
        # Built from the end: what follows once `written` elements are; element `written` is optional from lo on.
        tail = ""
        if item is not None:
            tail = _repeat("," + item, max(lo - len(prefix), 0), None if hi is None else hi - len(prefix))
        for written in range(len(prefix) - 1, 0, -1):
            step = "," + prefix[written] + tail
            tail = step if written < lo else _repeat(step, 0, 1)
        first = prefix[0] + tail
        return r"\[" + (first if lo > 0 else _repeat(first, 0, 1)) + r"\]"
