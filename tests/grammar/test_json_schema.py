"""JSON schema -> regex (kestrel.grammar.json_schema): instances judged by `jsonschema`, the converter's
deliberate narrowings, the regex dialect it emits, and the schemas it refuses."""

from __future__ import annotations

import datetime
import enum
import itertools
import json
import random
import re
import warnings
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from kestrel.grammar.json_schema import (
    SchemaError,
    choice_regex,
    escape,
    integer_range_regex,
    json_object_regex,
    schema_to_regex,
)

jsonschema = pytest.importorskip("jsonschema")


def compact(x) -> str:
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def matches(rx: str, text: str) -> bool:
    return re.fullmatch(rx, text) is not None


def is_valid(schema, x) -> bool:
    validator = jsonschema.Draft202012Validator
    return validator(schema, format_checker=validator.FORMAT_CHECKER).is_valid(x)


_QUANT = re.compile(r"\{\d+(?:,\d*)?\}")
_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|d|[\\.^$*+?()\[\]{}|\-])")
_CLASS_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|d|[\\\]\-])")


def assert_dialect(rx: str) -> None:
    """The regex compiler's dialect: escapes by name, `(?:` groups only, greedy quantifiers after an atom, no
    anchors; and no empty group or alternative."""
    assert "(?:)" not in rx and "(?:|" not in rx and "||" not in rx and "|)" not in rx
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert re.compile(rx).groups == 0
    i, depth, after_atom = 0, 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            m = _ESCAPE.match(rx, i)
            assert m, f"escape at {i}: {rx[i : i + 8]!r}"
            i, after_atom = m.end(), True
        elif c == "[":
            i += 2 if rx.startswith("[^", i) else 1
            assert rx[i] != "]", "an empty class or a leading ]"
            while rx[i] != "]":
                if rx[i] == "\\":
                    m = _CLASS_ESCAPE.match(rx, i)
                    assert m, f"class escape at {i}: {rx[i : i + 8]!r}"
                    i = m.end()
                else:
                    assert rx[i] != "[", "a [ inside a class"
                    i += 1
            i, after_atom = i + 1, True
        elif c == "(":
            assert rx.startswith("(?:", i), f"group kind at {i}"
            i, depth, after_atom = i + 3, depth + 1, False
        elif c == ")":
            depth -= 1
            assert depth >= 0
            i, after_atom = i + 1, True
        elif c == "|":
            i, after_atom = i + 1, False
        elif c in "*+?{":
            assert after_atom, f"quantifier without an atom (or stacked) at {i}"
            m = _QUANT.match(rx, i) if c == "{" else None
            assert c != "{" or m, f"bad brace at {i}"
            i, after_atom = (m.end() if m else i + 1), False
        else:
            assert c not in "^$]}", f"unescaped {c!r} at {i}"
            i, after_atom = i + 1, True
    assert depth == 0


def regex(schema, **kw) -> str:
    rx = schema_to_regex(schema, **kw)
    assert_dialect(rx)
    return rx


# --- instances judged by jsonschema -------------------------------------------------------------------

STRINGS = [
    "",
    "a",
    "é",
    "日本",
    "😀",
    'q"uote',
    "back\\slash",
    "new\nline",
    "tab\t",
    "\x00\x1f",
    "a/b",
    "\u2028",
]
OTHERS = [0, 1, -2, 3.5, True, False, None, [], [1], {}, {"a": 1}]

JUDGED = {
    "string": ({"type": "string"}, STRINGS + OTHERS),
    "string_length": (
        {"type": "string", "minLength": 2, "maxLength": 3},
        ["", "a", "ab", "a\n", '""', "\\\\", "日本", "😀😀😀", "😀😀😀😀", "abcd", "\t\t\t", "é", 12],
    ),
    "string_min_only": ({"type": "string", "minLength": 1}, ["", "x", "xyz" * 20, 1]),
    "string_max_zero": ({"type": "string", "maxLength": 0}, ["", "x"]),
    "integer": ({"type": "integer"}, [0, 1, -1, 123456789012345678901234567890, 1.5, -0.25, "1", True, None]),
    "number": ({"type": "number"}, [0, -0.5, 3.14, 1e10, 1e100, -2.5e-8, 7, "1", None, True, [1]]),
    "boolean": ({"type": "boolean"}, [True, False, 0, 1, "true", None]),
    "null": ({"type": "null"}, [None, 0, "", False, "null"]),
    "nullable_string": ({"type": ["string", "null"]}, ["x", None, 1, False]),
    "type_list": ({"type": ["integer", "boolean", "array"]}, [1, True, [], [1, "a"], "x", None, 2.5, {}]),
    "enum": (
        {
            "enum": [
                "a",
                'q"uote',
                "back\\slash",
                "日本😀",
                "new\nline",
                1,
                2.5,
                None,
                True,
                [1, "x"],
                {"k": "v"},
            ]
        },
        ["a", 'q"uote', "back\\slash", "日本😀", "new\nline", 1, 2.5, None, True, [1, "x"], {"k": "v"}]
        + ["b", "A", "quote", "日本", 2, False, [1], {"k": "w"}, {}, "back\\\\slash"],
    ),
    "enum_with_type": ({"type": "string", "enum": ["a", 1, "b", None]}, ["a", "b", 1, None, "c"]),
    "const": ({"const": "x\ny"}, ["x\ny", "xy", "x\\ny"]),
    "const_object": ({"const": {"a": [1, None]}}, [{"a": [1, None]}, {"a": [1]}, {"a": [1, None], "b": 1}]),
    "anyOf_optional": (
        {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
        [1, None, "1", 2.5],
    ),
    "oneOf": ({"oneOf": [{"type": "string", "maxLength": 1}, {"type": "integer"}]}, ["", "x", "xy", 3, None]),
    "allOf_one": ({"allOf": [{"type": "boolean"}], "title": "B"}, [True, False, None]),
    "object": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        [
            {"name": "x", "age": 1},
            {"name": "x"},
            {"age": 1},
            {},
            {"name": "x", "age": "1"},
            {"name": 1, "age": 1},
        ]
        + [{"name": "x", "age": 1, "extra": 2}, [], "x"],
    ),
    "object_inferred": (
        {"properties": {"a": {"type": "null"}}, "required": ["a"]},
        [{"a": None}, {}, {"a": 1}],
    ),
    "object_key_escaping": (
        {
            "type": "object",
            "properties": {'we"ird\\key.*': {"type": "integer"}, "日本": {"type": "null"}},
            "additionalProperties": False,
        },
        [{'we"ird\\key.*': 1, "日本": None}, {"日本": None}, {'we"ird\\key.*': 1}, {}, {"weird": 1}],
    ),
    "object_no_properties_closed": ({"type": "object", "additionalProperties": False}, [{}, {"a": 1}, []]),
    "map_of_integers": (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1}, {"a": 1, "b": -2, "é\n": 3}, {"a": "1"}, {"a": 1, "b": None}, [1]],
    ),
    "array": (
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        [[], [1], [1, 2], [1, 2, 3], [1, 2, 3, 4], ["a"], [1, "a"], [[1]], 1],
    ),
    "array_min_only": (
        {"type": "array", "items": {"type": "null"}, "minItems": 2},
        [[], [None], [None] * 2, [None] * 9],
    ),
    "array_max_zero": ({"type": "array", "maxItems": 0}, [[], [1]]),
    "array_inferred": ({"items": {"type": "string"}}, [[], ["a", "b"], [1]]),
    "array_any_items": ({"type": "array"}, [[], [1, "a", None, True, {"a": [1]}, [[]]]]),
    "tuple_closed": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [[], [1], [1, "a"], [1, "a", 2], ["a", 1], ["a"]],
    ),
    "tuple_exact": (
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "string"}],
            "minItems": 2,
            "maxItems": 2,
        },
        [[], [1], [1, "a"], [1, "a", 2], ["a", 1]],
    ),
    "prefix_then_items": (
        {
            "type": "array",
            "prefixItems": [{"type": "boolean"}, {"type": "null"}, {"type": "string"}],
            "items": {"type": "integer"},
            "minItems": 2,
            "maxItems": 5,
        },
        [[], [True], [True, None], [True, None, "x"], [True, None, "x", 1], [True, None, "x", 1, 2]]
        + [[True, None, "x", 1, 2, 3], [True, None, 1], [None, True], [True, None, "x", "y"]],
    ),
    "prefix_longer_than_max": (
        {"type": "array", "prefixItems": [{"type": "integer"}] * 4, "maxItems": 2},
        [[], [1], [1, 2], [1, 2, 3], ["a"]],
    ),
    "date": (
        {"type": "string", "format": "date"},
        ["2024-02-29", "1999-12-31", "2024-13-01", "24-01-01", "x", 1],
    ),
    "uuid": (
        {"type": "string", "format": "uuid"},
        ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000", "123e4567e89b", "x"],
    ),
    "email": ({"type": "string", "format": "email"}, ["a.b+c@example.co.uk", "x_y@d-e.org", "no-at-sign"]),
    "format_ignored_on_integer": ({"type": "integer", "format": "int64"}, [1, "1"]),
    "pattern": (
        {"type": "string", "pattern": r"^[a-z]+\d{2}$"},
        ["ab12", "a1", "AB12", "ab123", "ab12x", "", 5],
    ),
    "pattern_quote": (
        {"type": "string", "pattern": r'^say "(hi|yo)"\\?$'},
        ['say "hi"', 'say "yo"\\', "say hi"],
    ),
    "any": ({}, STRINGS + OTHERS + [{"a": [1, {"b": None}]}, [[[]]]]),
    "annotations": (
        {
            "title": "T",
            "description": "d",
            "$comment": "c",
            "examples": [1],
            "deprecated": True,
            "type": "null",
        },
        [None, 1],
    ),
}


@pytest.mark.parametrize("name", sorted(JUDGED))
def test_instances_judged_by_jsonschema(name):
    schema, instances = JUDGED[name]
    rx = regex(schema)
    for x in instances:
        assert matches(rx, compact(x)) == is_valid(schema, x), (name, x)


# --- objects ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_optional_properties_every_subset_every_required_mask(n):
    names = [f"p{i}" for i in range(n)]
    for mask in itertools.product([False, True], repeat=n):
        required = [p for p, r in zip(names, mask) if r]
        schema = {
            "type": "object",
            "properties": {p: {"type": "integer"} for p in names},
            "required": required,
        }
        schema["additionalProperties"] = False
        rx = regex(schema)
        for size in range(n + 1):
            for subset in itertools.combinations(range(n), size):
                x = {names[i]: i for i in subset}
                assert matches(rx, compact(x)) == is_valid(schema, x) == (set(required) <= set(x)), (mask, x)
        assert not matches(rx, "{,}") and not matches(rx, '{"p0":0,}') and not matches(rx, '{,"p0":0}')


def test_three_optional_one_required_in_each_position():
    for pos in range(4):
        names = [f"o{i}" for i in range(3)]
        names.insert(pos, "req")
        schema = {"type": "object", "properties": {p: {"type": "string"} for p in names}, "required": ["req"]}
        rx = regex(schema)
        for size in range(4):
            for subset in itertools.combinations([p for p in names if p != "req"], size):
                present = [p for p in names if p == "req" or p in subset]
                assert matches(rx, compact({p: p for p in present}))
                assert not matches(rx, compact({p: p for p in present if p != "req"}))


def test_objects_are_narrowed_to_declared_properties_in_schema_order():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    rx = regex(schema)
    for x in ({"b": 1, "a": 2}, {"a": 1, "extra": 2}):
        assert is_valid(schema, x) and not matches(rx, compact(x))
    assert matches(rx, '{"a":1,"b":2}')
    assert not matches(rx, '{"a": 1}') and not matches(rx, '{ "a":1}')  # no whitespace
    for additional in (True, False, {"type": "string"}):
        assert regex({**schema, "additionalProperties": additional}) == rx


def test_object_without_properties_is_any_object_bounded_by_depth():
    rx = regex({"type": "object"}, max_depth=2)
    assert matches(rx, compact({"a": [1, "x"], "b": {"c": None}}))
    assert not matches(rx, compact({"a": [[1]]}))
    assert not matches(rx, "[]")
    assert regex({"type": "object"}, max_depth=0) == r"\{\}"


# --- pydantic, $ref, recursion ------------------------------------------------------------------------


class Color(str, enum.Enum):
    RED = "red"
    GREEN = 'gr"een'


class Address(BaseModel):
    street: str
    city: str = Field(min_length=1, max_length=10)
    zip: str | None = None


class Person(BaseModel):
    name: str
    age: int
    email: str | None = None
    color: Color = Color.RED
    tags: list[str] = []
    address: Address
    previous: list[Address] = []
    pair: tuple[int, str] | None = None
    kind: Literal["a", "b"] = "a"
    scores: dict[str, float] = {}
    birthday: datetime.date | None = None


def test_pydantic_model_with_defs_and_nested_models():
    schema = Person.model_json_schema()
    assert "$defs" in schema
    rx = regex(schema)
    home = Address(street="1 Main St", city="Paris")
    people = [
        Person(name="Ann", age=30, address=home),
        Person(
            name='Bob "B" \\ é',
            age=-1,
            email="b@x.io",
            color=Color.GREEN,
            tags=["x", "日本", "😀"],
            address=Address(street="s", city="Tōkyō", zip="100-0001"),
            previous=[home, home],
            pair=(1, "one"),
            kind="b",
            scores={"math": 1.5, "art": -2.0},
            birthday=datetime.date(2000, 2, 29),
        ),
    ]
    for person in people:
        full = person.model_dump(mode="json")
        assert matches(rx, compact(full))
        assert Person.model_validate_json(compact(full)) == person
        minimal = {k: v for k, v in full.items() if k in schema["required"]}
        assert matches(rx, compact(minimal))
    good = people[1].model_dump(mode="json")
    for key, bad in [("kind", "c"), ("color", "blue"), ("pair", [1, 2]), ("birthday", "2000-02-30x")]:
        assert not matches(rx, compact({**good, key: bad})), key
    assert not matches(rx, compact({**good, "address": {**good["address"], "city": "x" * 11}}))
    assert not matches(rx, compact({k: v for k, v in good.items() if k != "age"}))


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Cat | Dog = Field(discriminator="pet_type")
    notes: dict[str, Any] = {}


def test_pydantic_discriminated_union_and_free_dict():
    schema = Owner.model_json_schema()
    assert "discriminator" in schema["properties"]["pet"]
    rx = regex(schema, max_depth=2)
    for owner in [
        Owner(pet=Cat(pet_type="cat", meows=3)),
        Owner(pet=Dog(pet_type="dog", barks=0.5), notes={"a": [1]}),
    ]:
        assert matches(rx, compact(owner.model_dump(mode="json")))
    assert not matches(rx, compact({"pet": {"pet_type": "cat", "barks": 0.5}}))
    assert not matches(rx, compact({"pet": {"pet_type": "cat", "meows": 1}, "notes": {"a": [[[1]]]}}))


def test_pydantic_v1_style_definitions_and_allof_ref():
    schema = {
        "title": "Order",
        "type": "object",
        "properties": {
            "item": {"allOf": [{"$ref": "#/definitions/Item"}], "description": "the item"},
            "qty": {"type": "integer"},
        },
        "required": ["item", "qty"],
        "definitions": {
            "Item": {"title": "Item", "type": "object", "properties": {"sku": {"type": "string"}}}
        },
    }
    rx = regex(schema)
    for x in [
        {"item": {"sku": "a"}, "qty": 1},
        {"item": {}, "qty": 2},
        {"item": {"sku": 1}, "qty": 1},
        {"qty": 1},
    ]:
        assert matches(rx, compact(x)) == is_valid(schema, x)


TREE = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "required": ["value", "children"],
        }
    },
    "$ref": "#/$defs/Node",
}


def tree(levels: int, width: int = 2) -> dict:
    children = [] if levels == 1 else [tree(levels - 1, width) for _ in range(width)]
    return {"value": levels, "children": children}


def test_recursive_schema_is_bounded_by_max_depth():
    for max_depth in (0, 1, 3):
        rx = regex(TREE, max_depth=max_depth)
        for levels in range(1, max_depth + 2):
            assert matches(rx, compact(tree(levels))), (max_depth, levels)
            assert is_valid(TREE, tree(levels))
        assert not matches(rx, compact(tree(max_depth + 2)))
    assert not matches(regex(TREE), compact({"value": 1, "children": [{"value": 2}]}))


def test_recursive_pydantic_model():
    class Category(BaseModel):
        name: str
        sub: list[Category] = []
        parent: Category | None = None

    schema = Category.model_json_schema()
    rx = regex(schema, max_depth=2)
    leaf = Category(name="leaf")
    x = Category(name="root", sub=[Category(name="mid", sub=[leaf], parent=leaf)])
    assert matches(rx, compact(x.model_dump(mode="json")))
    too_deep = Category(name="a", sub=[Category(name="b", sub=[Category(name="c", sub=[leaf])])])
    assert not matches(rx, compact(too_deep.model_dump(mode="json")))


def test_root_self_reference():
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}}
    rx = regex(schema, max_depth=1)
    assert matches(rx, '{"next":{"v":1},"v":2}') and matches(rx, '{"next":{}}')
    assert not matches(rx, '{"next":{"next":{}}}')


def test_recursion_without_a_way_out_is_refused():
    endless = {
        "$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}}
    }
    with pytest.raises(SchemaError, match=r"^#: no instance fits within max_depth=4"):
        schema_to_regex({**endless, "$ref": "#/$defs/A"})
    # An optional way out remains: only the branch past the depth is cut.
    rx = regex({**endless, "anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]})
    assert rx == "null"


# --- strings, formats, patterns -----------------------------------------------------------------------


def test_string_escapes_each_count_as_one_character():
    rx = regex({"type": "string", "minLength": 2, "maxLength": 2})
    for text in [r'"\"\\"', r'"\/\b"', r'"\f\n"', r'"\r\t"', r'"\u00E9\u00e9"', '"é😀"', r'"a\uD83D"']:
        assert matches(rx, text), text
    for text in [r'"\x41b"', r'"\u12"', r'"\"', '"a"b"', '"a\nb"', '"ab', r'"\ud83d"', '"abc"']:
        assert not matches(rx, text), text


def test_string_matches_every_json_spelling_and_no_broken_text():
    rx = regex({"type": "string"})
    rng = random.Random(0)
    alphabet = 'aZ0 "\\/\n\t\x00\x1f\x7fé日😀\u2028'
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(8)))
        assert matches(rx, compact(s)) and matches(rx, json.dumps(s))
    for text in ['"', '"""', "'a'", '"\\"', '"\\a"', '"\t"', "a", '"a"b"']:
        assert not matches(rx, text), text


def test_formats_beyond_jsonschemas_checks():
    rx = regex({"type": "string", "format": "email"})  # jsonschema's check only wants an @
    for s in ["@x.io", "a@", "a@b", "a b@c.io", "a@b.c", ".a@b.io"]:
        assert not matches(rx, compact(s)), s
    rx = regex({"type": "string", "format": "date-time"})  # this jsonschema checks neither time nor date-time
    for s in ["2024-01-31T23:59:59Z", "2024-01-31T00:00:00.5+05:30"]:
        assert matches(rx, compact(s)) and datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))
    for s in ["2024-01-31 00:00:00Z", "2024-01-31T00:00:00", "2024-1-31T00:00:00Z", "2024-01-31T00:00Z"]:
        assert not matches(rx, compact(s)), s
    rx = regex({"type": "string", "format": "time"})
    for s in ["12:30:00Z", "23:59:59.123+01:00", "00:00:00-05:30", "23:59:60Z"]:
        assert matches(rx, compact(s)), s
    for s in ["24:00:00Z", "12:30Z", "1:02:03Z", "12:30:00", "12:60:00Z", "12:30:00+1:00"]:
        assert not matches(rx, compact(s)), s
    rx = regex({"type": "string", "format": "uri"})
    for s in ["https://example.com/a_b?c=d&e=%20#f", "mailto:a@b.io", "urn:isbn:0451450523", "x+y.z-1:[::1]"]:
        assert matches(rx, compact(s)), s
    for s in ["example.com", "://x", "http://a b", "1http://x", 'http://a"b', "http://a\\b", ""]:
        assert not matches(rx, compact(s)), s


PATTERNS = [
    r"^\w+@[a-z]+\.com$",
    r"[ -~]{1,5}",
    r'a"b\\c.',
    r'^say "(hi|yo)"\\?$',
    r"(\\\.)+",
    r"(\d{3})-(?P<x>\d+)?x{,2}y{}",
    r"[^,]+",
    r"\D\W\S\s",
    r"(ab|c)*?d+?",
    r"[\w.\-]+",
    r"[]a]\]\}",
    r"\x41\u00e9\t\.\$",
]
ALPHABET = 'ab cdxy,-.@AÉé日0123456789"\\\n\t{}]_$'


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_translation_is_sound_and_keeps_json_safe_strings(pattern):
    """A JSON text the regex accepts decodes to a string the pattern fully matches; a string the pattern fully
    matches, when it holds no character JSON escapes (apart from the `"` and `\\` the pattern names), is
    accepted in its compact spelling."""
    rx = regex({"type": "string", "pattern": pattern})
    stripped = pattern.removeprefix("^")
    stripped = stripped[:-1] if stripped.endswith("$") and not stripped.endswith("\\$") else stripped
    rng = random.Random(pattern)
    for _ in range(3000):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(7)))
        text = compact(s)
        full = re.fullmatch(stripped, s, re.ASCII)  # JSON Schema's \d, \w, \s are ASCII (and Unicode spaces)
        assert not matches(rx, text) or full, (pattern, s)
        safe = (
            not any(c in "\n\t" for c in s)
            and ('"' not in s or '"' in pattern)
            and ("\\" not in s or "\\\\" in pattern)
        )
        if full and safe:
            assert matches(rx, text), (pattern, s)


def test_pattern_examples():
    rx = regex({"type": "string", "pattern": r"^[ -~]+$"})  # printable ASCII includes `"` and `\`
    assert matches(rx, '"a b~"') and not matches(rx, '"a"b"') and not matches(rx, r'"a\b"')
    rx = regex({"type": "string", "pattern": r'^a"b\\c$'})
    assert matches(rx, compact('a"b\\c'))
    rx = regex({"type": "string", "pattern": r"^.+$"})
    assert matches(rx, '"日本😀"') and not matches(rx, '""') and not matches(rx, '"a"b"')


@pytest.mark.parametrize(
    "pattern",
    [
        r"^a$|^b$",
        r"(?=a)b",
        r"\bword",
        r"a^b",
        r"(a)\1",
        r"(?i)a",
        r"a$b",
        r"[\W]",
        r"a*+",
        r"\Aa",
        r"(?#c)a",
    ],
)
def test_pattern_constructs_refused(pattern):
    schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    with pytest.raises(SchemaError, match=r"^#/properties/p/pattern: .* is unsupported"):
        schema_to_regex(schema)


# --- any value, json_object_regex -----------------------------------------------------------------------


def depth(x) -> int:
    if isinstance(x, dict):
        return 1 + max(map(depth, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(depth, x), default=0)
    return 0


def random_json(rng: random.Random, levels: int):
    kind = rng.randrange(8 if levels > 0 else 6)
    if kind == 0:
        return "".join(rng.choice('ab"\\\né😀 ') for _ in range(rng.randrange(4)))
    if kind == 1:
        return rng.choice([0, -1, 17, 2.5, -1e-7, 1e300, 10**20])
    if kind in (2, 3, 4, 5):
        return rng.choice([True, False, None, "k"])
    n = rng.randrange(4)
    if kind == 6:
        return [random_json(rng, levels - 1) for _ in range(n)]
    return {rng.choice(["a", "b", 'c"', "日"]) + str(i): random_json(rng, levels - 1) for i in range(n)}


def test_json_object_regex_accepts_objects_within_depth_only():
    rng = random.Random(1)
    for max_depth in (1, 2, 3):
        rx = json_object_regex(max_depth)
        assert_dialect(rx)
        for _ in range(400):
            x = random_json(rng, max_depth + 1)
            expected = isinstance(x, dict) and depth(x) <= max_depth
            assert matches(rx, compact(x)) == expected, (max_depth, x)
    rx = json_object_regex()
    assert matches(rx, compact({"a": {"b": [1, {"c": [None]}]}}))
    assert not matches(rx, compact({"a": {"b": [1, {"c": [[None]]}]}}))
    for text in ["[1]", '"x"', "1", "null", "{", '{"a":1,}', '{"a"}', "{1:2}", '{"a":01}', '{"a" :1}', " {}"]:
        assert not matches(rx, text), text
    with pytest.raises(ValueError):
        json_object_regex(0)


def test_any_value_refuses_malformed_json():
    rx = regex(True, max_depth=2)
    assert rx == regex({}, max_depth=2)
    for text in [
        "",
        "[1,]",
        "[,1]",
        "01",
        "1.",
        ".5",
        "-",
        "1e",
        "tru",
        "nul",
        "True",
        "NaN",
        "'a'",
        '{"a":}',
        "[[]",
    ]:
        assert not matches(rx, text), text
    for text in ["-0", "0.0", "1E+2", "[]", "{}", '[{"":1}]', '"\\u0000"']:
        assert matches(rx, text), text
    assert not matches(rx, "[[[1]]]") and matches(rx, "[[1]]")


# --- random schemas ---------------------------------------------------------------------------------------

SCALARS = ["", "a", 'q"', "\\", "é\n", 0, -3, 1.5, True, False, None]


def random_schema(rng: random.Random, levels: int) -> dict:
    kind = rng.choice(
        ["string", "integer", "number", "boolean", "null", "enum", "anyOf", "list"] + ["object"] * 2
    )
    if levels == 0 or kind in ("integer", "number", "boolean", "null"):
        return {"type": kind if kind in ("integer", "number", "boolean", "null") else "string"}
    if kind == "string":
        lo = rng.randrange(3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randrange(3)}
    if kind == "enum":
        return {"enum": rng.sample(SCALARS, rng.randrange(1, 4))}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, levels - 1) for _ in range(2)]}
    if kind == "list":
        if rng.random() < 0.5:
            return {"type": "array", "items": random_schema(rng, levels - 1), "maxItems": rng.randrange(4)}
        prefix = [random_schema(rng, levels - 1) for _ in range(rng.randrange(1, 3))]
        return {"type": "array", "prefixItems": prefix, "items": rng.choice([False, {"type": "integer"}])}
    names = [f"p{i}" for i in range(rng.randrange(1, 5))]
    return {
        "type": "object",
        "properties": {n: random_schema(rng, levels - 1) for n in names},
        "required": [n for n in names if rng.random() < 0.4],
        "additionalProperties": False,
    }


def random_instance(rng: random.Random, schema: dict):
    """Mostly instances in the converter's canonical form (declared properties in order), some invalid."""
    if rng.random() < 0.1:
        return rng.choice(SCALARS + [[], {}, [1], {"p0": None}])
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return random_instance(rng, rng.choice(schema["anyOf"]))
    kind = schema["type"]
    if kind == "string":
        return "".join(rng.choice('ab"\\\né日😀') for _ in range(rng.randrange(5)))
    if kind in ("integer", "number"):
        return rng.choice([0, 7, -12, 2.5, -0.125] if kind == "number" else [0, 7, -12])
    if kind in ("boolean", "null"):
        return rng.choice([True, False] if kind == "boolean" else [None])
    if kind == "object":
        return {n: random_instance(rng, s) for n, s in schema["properties"].items() if rng.random() < 0.7}
    prefix = schema.get("prefixItems", [])
    n = rng.randrange(len(prefix) + 3)
    subs = prefix + [schema["items"] if schema["items"] is not False else {"type": "null"}] * n
    return [random_instance(rng, s) for s in subs[:n]]


def test_random_schemas_agree_with_jsonschema_on_canonical_instances():
    rng = random.Random(3)
    for _ in range(150):
        schema = random_schema(rng, 3)
        rx = regex(schema)
        for _ in range(30):
            x = random_instance(rng, schema)
            assert matches(rx, compact(x)) == is_valid(schema, x), (schema, x)


# --- choice, escape -----------------------------------------------------------------------------------


def test_choice_regex_is_literal():
    choices = ["a.b", "(x)", "c|d", "[e]", "f*", "^g$", "h\\i", "j{2}", "日本", "new\nline", "+?"]
    rx = choice_regex(choices)
    assert_dialect(rx)
    for c in choices:
        assert matches(rx, c)
    for other in ["axb", "x", "c", "d", "e", "ff", "g", "jj", "h\\\\i", "", "a.b.", "(x)(x)"]:
        assert not matches(rx, other), other
    assert matches(choice_regex(["", "x"]), "") and matches(choice_regex(["x"]), "x")
    for bad in ([], "ab", [1], None):
        with pytest.raises(ValueError):
            choice_regex(bad)


def test_escape_round_trips():
    rng = random.Random(2)
    alphabet = "\\.^$*+?()[]{}|-,:#\"' \n\t\x00\x7fa日😀\u00a0\u200b"
    for _ in range(500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(10)))
        rx = escape(s)
        assert_dialect(rx)
        assert matches(rx, s) and not matches(rx, s + "a") and (not s or not matches(rx, s[:-1]))


# --- errors -------------------------------------------------------------------------------------------

REFUSED_KEYWORDS = [
    ("not", {}),
    ("if", {}),
    ("then", {}),
    ("else", {}),
    ("patternProperties", {}),
    ("dependentRequired", {}),
    ("dependentSchemas", {}),
    ("uniqueItems", True),
    ("minProperties", 1),
    ("maxProperties", 1),
    ("contains", {}),
    ("propertyNames", {}),
    ("unevaluatedProperties", False),
    ("additionalItems", False),
    ("nullable", True),
    ("multipleOf", 2),
]


@pytest.mark.parametrize(("keyword", "value"), REFUSED_KEYWORDS)
def test_refused_keywords_name_their_pointer(keyword, value):
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "items": {"type": "integer", keyword: value}}},
    }
    with pytest.raises(SchemaError, match=f"^#/properties/a~1b/items: unsupported keyword '{keyword}'"):
        schema_to_regex(schema)


BAD = [
    (False, "#: the schema false"),
    ({"properties": {"x": False}}, "#/properties/x: the schema false"),
    ([1], "#: a schema must be an object"),
    ({"properties": {"x": 3}}, "#/properties/x: a schema must be"),
    ({"type": 5}, "#/type: must be a type name"),
    ({"type": []}, "#/type: must be a type name"),
    ({"type": "str"}, "#/type: unknown type 'str'"),
    ({"type": "object", "properties": []}, "#/properties: must be an object"),
    ({"type": "object", "required": "a"}, "#/required: must be a list of strings"),
    ({"type": "object", "properties": {"a": {}}, "required": [1]}, "#/required: must be a list of strings"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "#/required: required property 'b'"),
    ({"type": "object", "additionalProperties": "no"}, "#/additionalProperties: must be a boolean"),
    ({"type": "array", "minItems": -1}, "#/minItems: must be a non-negative integer"),
    ({"type": "array", "maxItems": 1.5}, "#/maxItems: must be a non-negative integer"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "#: minItems 3 is greater than maxItems 2"),
    ({"type": "array", "items": [{}]}, "#/items: a list of schemas"),
    ({"type": "array", "prefixItems": {}}, "#/prefixItems: must be a list"),
    ({"type": "string", "minLength": "3"}, "#/minLength: must be a non-negative integer"),
    ({"type": "string", "maxLength": True}, "#/maxLength: must be a non-negative integer"),
    ({"type": "string", "minLength": 4, "maxLength": 2}, "#: minLength 4 is greater than maxLength 2"),
    ({"type": "string", "format": "hostname"}, "#/format: unsupported format 'hostname'"),
    ({"type": "string", "pattern": 5}, "#/pattern: must be a string"),
    ({"type": "string", "pattern": "("}, "#/pattern: invalid regex"),
    ({"type": "string", "pattern": "a", "format": "date"}, "#: pattern cannot be combined with format"),
    ({"type": "string", "format": "date", "maxLength": 10}, "#: minLength/maxLength cannot be combined"),
    ({"enum": []}, "#/enum: must be a non-empty list"),
    ({"enum": "a"}, "#/enum: must be a non-empty list"),
    ({"enum": [1, float("nan")]}, "#/enum/1: nan is not a JSON value"),
    ({"type": "string", "enum": [1, 2]}, "#: no enum/const value satisfies"),
    ({"const": 1, "enum": [2]}, "#: const 1 is not one of enum's values"),
    ({"anyOf": []}, "#/anyOf: must be a non-empty list"),
    ({"oneOf": {}}, "#/oneOf: must be a non-empty list"),
    ({"allOf": [{}, {}]}, "#/allOf: only an allOf of exactly one"),
    ({"anyOf": [{}], "type": "string"}, "#: 'anyOf' cannot be combined with 'type'"),
    (
        {"$ref": "#/$defs/A", "$defs": {"A": {}}, "minLength": 1},
        "#: '\\$ref' cannot be combined with 'minLength'",
    ),
    ({"$ref": 5}, "#/\\$ref: must be a string"),
    ({"$ref": "#/$defs/Missing", "$defs": {}}, "#/\\$ref: unresolvable reference '#/\\$defs/Missing'"),
    ({"properties": {"p": {"$ref": "#/definitions/X"}}}, "#/properties/p/\\$ref: unresolvable reference"),
    ({"$ref": "https://example.com/s.json"}, "#/\\$ref: unsupported reference"),
    ({"$ref": "#/properties/a"}, "#/\\$ref: unsupported reference"),
    ({"$ref": "#/$defs/A/$defs/B", "$defs": {}}, "#/\\$ref: unsupported reference"),
    (
        {"$ref": "#/$defs/A", "$defs": {"A": {"type": "integer", "multipleOf": 3}}},
        "#/\\$defs/A: unsupported keyword",
    ),
]


@pytest.mark.parametrize(("schema", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_schemas_are_refused_with_their_pointer(schema, message):
    with pytest.raises(SchemaError, match="^" + message.replace("[", r"\[")):
        schema_to_regex(schema)


def test_bad_max_depth():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            schema_to_regex({}, max_depth=bad)


# --- size ---------------------------------------------------------------------------------------------


def test_pattern_size_stays_linear_in_optional_properties():
    def object_regex(n: int, required=()) -> str:
        props = {f"p{i}": {"type": "string", "maxLength": 20} for i in range(n)}
        return regex({"type": "object", "properties": props, "required": list(required)})

    assert len(object_regex(20)) < 5_000
    assert len(object_regex(40)) < 2.1 * len(object_regex(20))
    assert len(object_regex(20, ["p10", "p19"])) < 5_000
    rx = object_regex(200)
    assert (
        matches(rx, '{"p3":"x","p199":"y"}')
        and matches(rx, "{}")
        and not matches(rx, '{"p199":"y","p3":"x"}')
    )


def test_any_value_sizes():
    """The any-value pattern grows fourfold per level (arrays and objects each hold their item twice)."""
    assert len(json_object_regex()) < 150_000
    assert len(regex({})) < 80_000
    assert len(regex({}, max_depth=2)) < 5_000


INTEGER_RANGES = [(0, 0), (0, 9), (1, 10), (-5, 5), (None, None), (None, 0), (0, None), (-1, None), (None, -1),
                  (7, 7), (-7, -7), (13, 457), (99, 1000), (-1000, -99), (1, None), (100, None), (-100, None),
                  (-3, 1_000_000)]  # fmt: skip


@pytest.mark.parametrize(("lo", "hi"), INTEGER_RANGES)
def test_integer_ranges_are_exact(lo, hi):
    """integer_range_regex(lo, hi) matches the canonical decimals of [lo, hi] and nothing else: every integer
    near the bounds and across a seeded sample, and no leading zero or -0."""
    pattern = re.compile(integer_range_regex(lo, hi))
    rng = random.Random(lo or 0)
    near = [b + d for b in (lo, hi, 0, 10, 100, 1000) if b is not None for d in range(-12, 13)]
    for v in near + [rng.randint(-(10**7), 10**7) for _ in range(2000)]:
        want = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert bool(pattern.fullmatch(str(v))) == want, (lo, hi, v, pattern.pattern)
    for bad in ("-0", "01", "00", "-01", "", "-", "1.0", "+1"):
        assert not pattern.fullmatch(bad), (lo, hi, bad)


def test_integer_bounds_as_pydantic_writes_them():
    """ge / gt / le / lt (minimum, exclusiveMinimum, maximum, exclusiveMaximum), fractional bounds rounded
    inwards, on `integer` and on an integer-or-null: each instance's match agrees with jsonschema."""
    schemas = [
        {"type": "integer", "minimum": 1, "maximum": 12},
        {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
        {"type": "integer", "minimum": -2.5, "exclusiveMaximum": 3.5},
        {"type": ["integer", "null"], "maximum": -10},
        {"type": "integer", "minimum": 18},
    ]
    for schema in schemas:
        pattern = re.compile(schema_to_regex(schema))
        for v in [*range(-40, 140), None, 2.5]:
            text = json.dumps(v)
            want = jsonschema.Draft202012Validator(schema).is_valid(v) and not isinstance(v, float)
            assert bool(pattern.fullmatch(text)) == want, (schema, text)


NUMBER_BOUND_VALUES = [None, -3, -1, 0, 1, 2, 5]


@pytest.mark.parametrize("lower", ["minimum", "exclusiveMinimum"])
@pytest.mark.parametrize("upper", ["maximum", "exclusiveMaximum"])
def test_number_bounds_agree_with_jsonschema(lower, upper):
    """A number between whole bounds (pydantic's `confloat(ge=0, le=1)`), every pair of bounds from a grid and
    either kind: each exponent-free decimal on a grid of eighths matches where jsonschema takes it, and the
    pattern never writes an exponent, -0 or a leading zero. A pair with no number between is refused."""
    texts = {json.dumps(i / 8) for i in range(-320, 321)} | {str(i) for i in range(-40, 41)}
    texts |= {"1.000", "2.50", "0.0", "0.001", "-0.001", "2.0001", "-0", "-0.0", "01.5", "1e2", "3.", ".5"}
    exact = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?")
    for lo, hi in itertools.product(NUMBER_BOUND_VALUES, NUMBER_BOUND_VALUES):
        if lo is None and hi is None:
            continue
        schema = {"type": "number"}
        schema.update({lower: lo} if lo is not None else {})
        schema.update({upper: hi} if hi is not None else {})
        validator = jsonschema.Draft202012Validator(schema)
        takes = {t for t in texts if exact.fullmatch(t) and validator.is_valid(json.loads(t))}
        takes -= {t for t in takes if re.fullmatch(r"-0(?:\.0+)?", t)}  # (-0 is written as 0)
        if not takes:
            with pytest.raises(SchemaError, match="^#: no number lies within its bounds"):
                schema_to_regex(schema)
            continue
        pattern = re.compile(schema_to_regex(schema))
        for t in texts:
            assert bool(pattern.fullmatch(t)) == (t in takes), (schema, t, pattern.pattern)


def test_bounds_past_thirty_digits_narrow_the_range():
    """A bound past 30 digits (1e300) narrows the range to the integers of 30 digits (it had nested a group a
    digit: refused by the automaton, past ~1,000 digits a RecursionError); a range of only longer numbers is
    refused; a type whose bounds leave nothing leaves the other types."""
    pattern = re.compile(schema_to_regex({"type": "integer", "minimum": -(10**1400), "maximum": 1e300}))
    for text, ok in (("0", True), ("-" + "9" * 30, True), ("9" * 30, True), ("1" + "0" * 30, False)):
        assert bool(pattern.fullmatch(text)) == ok, text
    number = re.compile(schema_to_regex({"type": "number", "exclusiveMinimum": 0, "maximum": 1e300}))
    assert (
        number.fullmatch("9" * 29 + ".5")
        and not number.fullmatch("1" + "0" * 30)
        and not number.fullmatch("0")
    )
    for schema in ({"type": "integer", "minimum": 10**40}, {"type": "number", "maximum": -(10**40)}):
        with pytest.raises(SchemaError, match="more than 30 digits"):
            schema_to_regex(schema)
    either = re.compile(schema_to_regex({"type": ["integer", "null"], "minimum": 5, "maximum": 4}))
    assert either.fullmatch("null") and not either.fullmatch("5")
    branches = {"anyOf": [{"type": "integer", "minimum": 5, "maximum": 4}, {"type": "null"}]}
    assert re.fullmatch(schema_to_regex(branches), "null") and not re.fullmatch(
        schema_to_regex(branches), "4"
    )
    with pytest.raises(SchemaError, match="^#/anyOf/1: no integer"):
        schema_to_regex({"anyOf": [{"type": "integer", "minimum": 5, "maximum": 4}] * 2})


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "number", "minimum": 0.5}, "#/minimum: a number's bound must be a whole number"),
        ({"minimum": 3}, "#: 'minimum' needs a type integer or number beside it"),
        ({"type": "string", "maximum": 3}, "#: 'maximum' needs a type integer or number"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "#: no integer lies within its bounds"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "#: no integer"),
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, "#/exclusiveMinimum: must be a number"),
        ({"type": "integer", "maximum": "9"}, "#/maximum: must be a number"),
        ({"type": "number", "multipleOf": 0.5}, "#: unsupported keyword 'multipleOf'"),
    ],
)
def test_bounds_that_cannot_be_honoured_are_refused(schema, message):
    with pytest.raises(SchemaError, match="^" + message):
        schema_to_regex(schema)
