"""How to sample a request: vLLM's `SamplingParams` for the common arguments, validated on construction."""

from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import dataclass, field

from kestrel.grammar.json_schema import SchemaError, choice_regex, json_object_regex, schema_to_regex
from kestrel.grammar.regex import PatternError, check_pattern, unanchored

# Temperatures below this sample greedily (vLLM's rule): the logits divided by 1e-40 overflow to inf, and the
# softmax of infs is NaN.
GREEDY_BELOW = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds go to the device as int64
INT32_MAX = 2**31 - 1  # top_k and token ids go to the device as int32/int64 beside vocabularies far smaller
# Stop strings are matched against every new token on the engine's thread, each string in turn: 200,000 of them
# (a 3 MB request) made every other stream's tokens 14x slower. OpenAI takes 4; lm-evaluation-harness sends a few.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids: looked up per token on that thread too (1M of them: 7 ms a token)
# OpenAI's range for a logit_bias value: -100 bans a token, 100 makes it the only one taken
MAX_LOGIT_BIAS = 100.0
# logit_bias entries and allowed_token_ids: more than any vocabulary served here (K3's 163,840) needs
MAX_TOKEN_SET = 262_144


_NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTEGERS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed")
# None: no limit, no logprobs, no prompt logprobs, a random seed
_OPTIONAL = ("max_tokens", "logprobs", "prompt_logprobs", "seed")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's structured outputs; one of the fields): `json` a JSON schema (a
    dict, or its JSON text), `regex` a regular expression (whole-output match), `choice` one of these strings,
    `json_object` any JSON object (OpenAI's JSON mode). JSON comes out compact, properties in the schema's order
    (`kestrel.grammar.json_schema` says what a schema may use). Checked on construction (ValueError).

    `thought`: a thinking model's reasoning comes first, free, and the constraint holds from after its
    `</think>` (vLLM's structured outputs with a reasoning parser): "optional" where the output may open with
    `<think>` (thinking may be off), "opened" where it starts inside the thought (the prompt opened it)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    thought: str | None = None

    def __post_init__(self):
        given = [name for name in _STRUCTURED if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs take exactly one of {', '.join(_STRUCTURED)}, not {given or 'none'}"
            )
        if self.thought not in (None, "optional", "opened"):
            raise ValueError(
                f"structured outputs thought is 'optional', 'opened' or None, not {self.thought!r}"
            )
        self.pattern  # noqa: B018 (made now: a bad schema is an error here)

    @property
    def kind(self) -> str:
        return next(name for name in _STRUCTURED if getattr(self, name) is not None)

    def __getstate__(self) -> dict:
        """Copies and pickles leave out the grammar an engine pinned here (`Engine.grammar_of`)."""
        return {k: v for k, v in self.__dict__.items() if k != "_compiled"}

    @functools.cached_property
    def pattern(self) -> str:
        """The regular expression the output must match whole (`kestrel.grammar.regex`'s dialect); made once,
        on construction (the engine reads it at each check: a schema's JSON text was dumped again each time)."""
        body = self._body()
        return body if self.thought is None else _after_thought(body, self.thought)

    def _body(self) -> str:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured outputs json: the schema is not valid JSON ({e})") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(
                    f"structured outputs json: a schema is an object, not {type(value).__name__}"
                )
            # (the text as given: json.dumps keeps the properties' order, which the output follows)
            return _pattern_of("json", json.dumps(value))
        if kind == "regex":
            if not isinstance(value, str):
                raise ValueError(f"structured outputs regex must be a string, not {value!r}")
            try:
                check_pattern(value)
            except PatternError as e:
                raise ValueError(f"structured outputs regex: {e}") from None
        if kind == "choice":
            if (
                not isinstance(value, (list, tuple))
                or not value
                or not all(isinstance(c, str) for c in value)
            ):
                raise ValueError("structured outputs choice must be a non-empty list of strings")
            return choice_regex(list(value))
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured outputs json_object must be true, not {value!r}")
        return value if kind == "regex" else json_object_regex()


_STRUCTURED = ("json", "regex", "choice", "json_object")

# Any text up to and with the first `</think>`: a walk of the automaton that finds that word (its letters differ,
# so a mismatch falls back to the start, or to `<`): from `<`, any of `/`, `/t`, ..., `/think` then `<` again
# returns to `<` (_BACK), and a letter other than the next one's (or `<`) to the start (_AWAY).
_BACK = "(?:/(?:t(?:h(?:i(?:n(?:k)?)?)?)?)?)?<"
_AWAY = "(?:[^</]|/(?:[^<t]|t(?:[^<h]|h(?:[^<i]|i(?:[^<n]|n(?:[^<k]|k[^<>]))))))"
THOUGHT_PATTERN = f"(?:[^<]|<(?:{_BACK})*{_AWAY})*<(?:{_BACK})*/think>"


def _after_thought(body: str, thought: str) -> str:
    """`body` (its anchors dropped: they hold anyway) after a thought: an optional one, or one the output starts
    inside (its `<think>` may be written again); whitespace between the thought and the body is free."""
    body = unanchored(body)
    head = (
        f"(?:\\s*<think>{THOUGHT_PATTERN}\\s*)?"
        if thought == "optional"
        else f"(?:<think>)?{THOUGHT_PATTERN}\\s*"
    )
    return f"{head}(?:{body})"


@functools.lru_cache(maxsize=256)
def _pattern_of(kind: str, canonical: str) -> str:
    try:
        return schema_to_regex(json.loads(canonical))
    except SchemaError as e:
        raise ValueError(f"structured outputs json: {e}") from None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = (
        1.0  # > 1 discourages tokens already in prompt or output (divides positive logits)
    )
    presence_penalty: float = 0.0  # OpenAI semantics, subtracted once per token present in the output
    frequency_penalty: float = 0.0  # OpenAI semantics, subtracted per occurrence in the output
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None  # None = a random seed drawn at admission
    logprobs: int | None = None  # None = off; k >= 0: the sampled token's logprob and the top k alternatives
    # None = off; k >= 0: each prompt token's logprob given the tokens before it, and the top k alternatives
    # (vLLM's; the prompt is then computed whole, with no prefix-cache hit)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI's: token id -> a value in [-100, 100] added to its logit before the penalties (as vLLM)
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens can be sampled (the others' logits -inf); None: every token
    allowed_token_ids: list[int] | None = None
    # vLLM's: the output must match a JSON schema, a regex, a choice or be a JSON object (StructuredOutputsParams)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop must be a string or a list of strings")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids must be a list of token ids")
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token ids to numbers, not {self.logit_bias!r}")
        self.logit_bias = self.logit_bias or None  # {} asks for nothing
        if self.allowed_token_ids is not None:
            allowed = _as_list(self.allowed_token_ids, "allowed_token_ids must be a list of token ids")
            ok = len(allowed) <= MAX_TOKEN_SET and _all_token_ids(allowed)
            self.allowed_token_ids = sorted(set(allowed)) if ok else allowed  # validate() names what is wrong
        self.validate()
        # a copy in id order, as allowed_token_ids: the largest of each is its last (max_token_ids)
        if self.logit_bias:
            self.logit_bias = dict(sorted(self.logit_bias.items()))

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in _NUMBERS + _INTEGERS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            integer = isinstance(value, int) and not isinstance(value, bool)
            if not integer and (name in _INTEGERS or not isinstance(value, float)):
                kind = "an integer" if name in _INTEGERS else "a number"
                raise ValueError(f"{name} must be {kind}, not {value!r}")
        checks = [  # (the types are checked above)
            (self.n >= 1, "n must be an integer >= 1"),
            (
                math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature must be a finite number >= 0",
            ),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (
                0 <= self.top_k <= INT32_MAX,
                f"top_k must be in [0, {INT32_MAX}] (or -1 for off)",
            ),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens must be an integer >= 1",
            ),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens must be <= max_tokens ({self.max_tokens})",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"stop takes at most {MAX_STOP_STRINGS} strings"),
            (
                all(len(s) <= MAX_STOP_CHARS for s in self.stop if isinstance(s, str)),
                f"stop strings must be at most {MAX_STOP_CHARS} characters each",
            ),
            (_all_token_ids(self.stop_token_ids), "stop_token_ids must be token ids"),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs must be in [0, 20]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
            (
                _all_token_ids(self.logit_bias or ()),
                f"logit_bias keys must be token ids (integers in [0, {INT32_MAX}])",
            ),
            (
                all(
                    _is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
                    for v in (self.logit_bias or {}).values()
                ),
                f"logit_bias values must be numbers in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
            (
                self.allowed_token_ids is None or _all_token_ids(self.allowed_token_ids),
                f"allowed_token_ids must be token ids (integers in [0, {INT32_MAX}])",
            ),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids must not be empty (no token could be sampled)",
            ),
            (len(self.logit_bias or ()) <= MAX_TOKEN_SET, f"logit_bias takes at most {MAX_TOKEN_SET} tokens"),
            (
                len(self.allowed_token_ids or ()) <= MAX_TOKEN_SET,
                f"allowed_token_ids takes at most {MAX_TOKEN_SET} tokens",
            ),
            (
                self.structured_outputs is None
                or isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs must be a StructuredOutputsParams",
            ),
            (
                self.structured_outputs is None or self.allowed_token_ids is None,
                "allowed_token_ids cannot be combined with structured outputs (the grammar says which tokens go)",
            ),
            (
                self.structured_outputs is None or not self.ignore_eos,
                "ignore_eos cannot be combined with structured outputs (a complete output ends with EOS)",
            ),
            (
                self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
                f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def children(self) -> list[SamplingParams]:
        """n independent samples as n requests of n=1. With a seed, the first keeps it and the j-th takes
        `child_seed(seed, j)`: reproducible, and seeds s and s + 1 share no sample (seed + j would)."""
        seeds = [None] * self.n if self.seed is None else [child_seed(self.seed, j) for j in range(self.n)]
        return [self._child(seed) for seed in seeds]

    @property
    def max_token_ids(self) -> dict[str, int]:
        """Each token-id field's largest id (those given), for the engine's vocabulary check: the sorted fields'
        last, not a walk over 262,144 ids once a sample."""
        largest = {"stop_token_ids": max(self.stop_token_ids, default=None)}
        largest["logit_bias"] = next(reversed(self.logit_bias)) if self.logit_bias else None
        largest["allowed_token_ids"] = self.allowed_token_ids[-1] if self.allowed_token_ids else None
        return {name: i for name, i in largest.items() if i is not None}

    def _child(self, seed: int | None) -> SamplingParams:
        """A copy with n 1 and this seed, not validated again (these are): 128 samples of a request with 262,144
        allowed ids had taken 16 s of the server's event loop in `dataclasses.replace`."""
        child = copy.copy(self)
        child.n, child.seed = 1, seed
        return child


def _as_list(value, message: str) -> list:
    """A list of `value`'s items (None: empty); ValueError(message) for what holds no items (an int: the
    TypeError "'int' object is not iterable" before)."""
    try:
        return list(value or [])
    except TypeError:
        raise ValueError(f"{message}, not {value!r}") from None


def _all_token_ids(ids) -> bool:
    """Every item an int (not a bool) in [0, INT32_MAX]: what can go to the device as a token id."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in ids)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def child_seed(seed: int, j: int) -> int:
    """The j-th sample's seed of a request seeded `seed` (j = 0: the seed itself), an int64: SplitMix64's mix of
    seed + j * the golden ratio."""
    if j == 0:
        return seed
    z = (seed + j * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z > INT64_MAX else z
