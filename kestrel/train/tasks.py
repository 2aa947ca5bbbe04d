"""Task families for the demo model: procedural problems with short worked steps and a verifier.

Every family has `generate(seed, index) -> Example`, deterministic for (seed, index), and `check(meta, answer)`;
the module-level `verify(example_or_meta, completion)` pulls the last `Answer: ...` line out of a completion
and scores it. Four families wrap reasoning-gym generators and add worked steps a small model can imitate;
`retrieval` (long context) is written here.

Difficulty: each family has one knob, `level`, naming a preset in its `LEVELS` table:

    family            easy                          medium                          hard
    chain_sum         3-5 terms, 1-2 digits *       -                               5-8 terms, 2-3 digits
    basic_arithmetic  2-3 terms, 1 digit *          3-4 terms, 1-2 digits           4-6 terms, 2 digits
    gsm_symbolic      solutions of <= 2 steps       <= 3 steps                      any template *
    countdown         3 numbers 1-20, target 1-50   3-4 of 1-50, target 10-200 *    4 of 1-100, target 100-999
    retrieval         1 distractor                  1-3 distractors *               3 distractors sharing a name part

(* = the default level.) Retrieval's other knob is `context_tokens` per call: 2K is easy, 8K medium, 32K hard.

Held-out split: seeds at or above `HELDOUT_SEED_OFFSET` are the held-out namespace. Small problem spaces
(a 3-term 1-digit chain sum) would repeat across any two seed ranges, so a problem's identity (its `key`, e.g.
the expression) is also hashed into one of `HELDOUT_BUCKETS` buckets: held-out seeds only produce problems of
bucket 0, train seeds never do. Train and held-out prompts are therefore disjoint at any sample size.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import operator
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from kestrel.train.filler import FillerStream, person_name

HELDOUT_SEED_OFFSET = 10**9
HELDOUT_BUCKETS = 8
_MAX_ATTEMPTS = 1000
_LONG_DECIMAL = re.compile(r"\d\.\d{4,}")
_ANSWER_LINE = re.compile(r"^\s*Answer:[ \t]*(.*?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Example:
    family: str
    prompt: str
    reasoning: str  # worked steps, without the final answer line
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-serializable; holds what `verify` needs
    # A tail of `prompt` that training also predicts (the retrieval question: its name must be copied from the
    # facts, the skill the answer needs); "" trains on the assistant turn only.
    trained_prompt_tail: str = ""

    def __post_init__(self):
        if not self.prompt.endswith(self.trained_prompt_tail):
            raise ValueError(f"trained_prompt_tail {self.trained_prompt_tail!r} is not a tail of the prompt")


@dataclass(frozen=True)
class _Draft:
    """A drawn problem before rendering; `key` is its identity for the train / held-out partition."""

    key: str
    data: dict[str, Any]


def is_heldout_seed(seed: int) -> bool:
    if seed < 0:
        raise ValueError(f"seeds are non-negative, got {seed}")
    return seed >= HELDOUT_SEED_OFFSET


def derive_seed(*parts) -> int:
    """A 64-bit seed from any reprable parts, stable across processes (unlike `hash`)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _in_heldout_bucket(key: str) -> bool:
    return derive_seed("split", key) % HELDOUT_BUCKETS == 0


class Family:
    """A task family: draw a problem from a derived seed, keep it if it falls on the seed's side of the split,
    render its prompt, steps and answer."""

    name: ClassVar[str]
    LEVELS: ClassVar[dict[str, dict[str, Any]]]
    DEFAULT_LEVEL: ClassVar[str]

    def __init__(self, level: str | None = None):
        self.level = level or self.DEFAULT_LEVEL
        if self.level not in self.LEVELS:
            raise ValueError(f"{self.name}: unknown level {self.level!r}; choose from {sorted(self.LEVELS)}")
        self.settings = self.LEVELS[self.level]

    def generate(self, seed: int, index: int, **kwargs) -> Example:
        heldout = is_heldout_seed(seed)
        for attempt in range(_MAX_ATTEMPTS):
            draft = self._draw(derive_seed(self.name, seed, index, attempt))
            if draft is not None and _in_heldout_bucket(draft.key) == heldout:
                return self._finish(draft, **kwargs)
        raise RuntimeError(f"{self.name}: no problem found for seed {seed}, index {index}")

    def _draw(self, sub_seed: int) -> _Draft | None:
        """A problem, or None when the level's filter rejects it."""
        raise NotImplementedError

    def _finish(self, draft: _Draft, **kwargs) -> Example:
        raise NotImplementedError

    def check(self, meta: dict, answer: str) -> bool:
        raise NotImplementedError

    def _example(
        self, prompt: str, reasoning: str, answer: str, trained_prompt_tail: str = "", **meta
    ) -> Example:
        meta = {"family": self.name, "level": self.level, "answer": answer, **meta}
        return Example(self.name, prompt, reasoning, answer, meta, trained_prompt_tail)


# ---- arithmetic helpers -------------------------------------------------------------------------------------

_BINARY = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
}


def _evaluate_with_steps(expression: str) -> tuple[Fraction, list[str]]:
    """Evaluate an expression of integers, + - * / and parentheses bottom-up, one `a op b = c` line per
    operation in Python's evaluation order (which honours precedence)."""
    steps: list[str] = []

    def fmt(v: Fraction) -> str:
        return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"

    def visit(node) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            if isinstance(node.operand, ast.Constant):
                return -visit(node.operand)
            value = visit(node.operand)
            steps.append(f"-({fmt(value)}) = {fmt(-value)}")
            return -value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = visit(node.left), visit(node.right)
            symbol, fn = _BINARY[type(node.op)]
            value = fn(left, right)
            steps.append(f"{fmt(left)} {symbol} {fmt(right)} = {fmt(value)}")
            return value
        raise ValueError(f"unsupported expression {expression!r}")

    return visit(ast.parse(expression, mode="eval").body), steps


def _int_answer(answer: str) -> int | None:
    try:
        return int(answer.strip())
    except ValueError:
        return None


class _ReasoningGymFamily(Family):
    """A family drawn from a reasoning-gym dataset: one single-item dataset per derived seed."""

    rg_name: ClassVar[str]

    def _entry(self, sub_seed: int, **config) -> dict:
        return _reasoning_gym().create_dataset(self.rg_name, size=1, seed=sub_seed, **config)[0]


@functools.cache
def _scorer(rg_name: str):
    """A reasoning-gym dataset instance, for its `score_answer`."""
    return _reasoning_gym().create_dataset(rg_name, size=1, seed=0)


@functools.cache
def _reasoning_gym():
    """reasoning-gym imports `pycosat` (a C extension) at package import, for SAT puzzles Kestrel never draws.
    Where pycosat cannot be installed (the GPU image has no wheel for it), an empty placeholder module lets the
    package import; calling into it raises AttributeError, so no SAT family could silently misbehave."""
    import sys
    import types

    try:
        import pycosat  # noqa: F401
    except ImportError:
        sys.modules["pycosat"] = types.ModuleType("pycosat", "placeholder: pycosat is not installed")
    import reasoning_gym

    return reasoning_gym


class ChainSum(_ReasoningGymFamily):
    """`a + b - c ...`; steps are the running partial sums. Scored by exact integer match."""

    name = rg_name = "chain_sum"
    LEVELS = {
        "easy": dict(min_terms=3, max_terms=5, min_digits=1, max_digits=2),
        "hard": dict(min_terms=5, max_terms=8, min_digits=2, max_digits=3),
    }
    DEFAULT_LEVEL = "easy"

    def _draw(self, sub_seed):
        entry = self._entry(sub_seed, **self.settings)
        return _Draft(entry["metadata"]["expression"], entry)

    def _finish(self, draft):
        expression = draft.key
        terms = expression.split()
        total, steps = int(terms[0]), []
        for op, term in zip(terms[1::2], terms[2::2]):
            new = total + int(term) if op == "+" else total - int(term)
            steps.append(f"{total} {op} {term} = {new}")
            total = new
        assert str(total) == draft.data["answer"], (expression, total)
        return self._example(draft.data["question"], "\n".join(steps), str(total), expression=expression)

    def check(self, meta, answer):
        return _int_answer(answer) == int(meta["answer"])


class BasicArithmetic(_ReasoningGymFamily):
    """`a op b op c` with + - *, no parentheses; steps follow the evaluation order (products first, then left
    to right), each with the expression that remains. Scored by exact integer match.

    The answer is recomputed here with the usual precedence: reasoning-gym 0.1.25's parenthesis-free generator
    evaluates strictly left to right (it answers -3 for `4 - 5 * 3`)."""

    name = rg_name = "basic_arithmetic"
    LEVELS = {
        "easy": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1),
        "medium": dict(min_terms=3, max_terms=4, min_digits=1, max_digits=2),
        "hard": dict(min_terms=4, max_terms=6, min_digits=2, max_digits=2),
    }
    DEFAULT_LEVEL = "easy"

    def _draw(self, sub_seed):
        config = dict(operators=("+", "-", "*"), allow_parentheses=False, allow_negation=False)
        entry = self._entry(sub_seed, **self.settings, **config)
        return _Draft(entry["metadata"]["expression"], entry)

    def _finish(self, draft):
        terms = draft.key.split()
        steps = []
        while len(terms) > 1:
            i = terms.index("*") if "*" in terms else 1
            a, op, b = int(terms[i - 1]), terms[i], int(terms[i + 1])
            value = a * b if op == "*" else a + b if op == "+" else a - b
            terms[i - 1 : i + 2] = [str(value)]
            rest = f" -> {' '.join(terms)}" if len(terms) > 1 else ""
            steps.append(f"{a} {op} {b} = {value}{rest}")
        answer = terms[0]
        return self._example(draft.data["question"], "\n".join(steps), answer, expression=draft.key)

    def check(self, meta, answer):
        return _int_answer(answer) == int(meta["answer"])


class GsmSymbolic(_ReasoningGymFamily):
    """Grade-school word problems from templates; steps are the template's own solution text (`answer_cot`)
    without its `#### n` line. Problems with a non-integer answer or float noise in the text are skipped.
    Scored by reasoning-gym (first number in the answer equals the result)."""

    name = rg_name = "gsm_symbolic"
    LEVELS = {"easy": dict(max_steps=2), "medium": dict(max_steps=3), "hard": dict(max_steps=None)}
    DEFAULT_LEVEL = "hard"

    def _draw(self, sub_seed):
        entry = self._entry(sub_seed)
        cot = entry["metadata"].get("answer_cot") or ""
        steps = [line for line in cot.strip().splitlines() if line.strip() and not line.startswith("####")]
        if not steps:
            steps = [f"The result is {entry['answer']}."]
        max_steps = self.settings["max_steps"]
        if max_steps is not None and len(steps) > max_steps:
            return None
        if _int_answer(entry["answer"]) is None or _LONG_DECIMAL.search(entry["question"] + "\n".join(steps)):
            return None  # a few templates print float noise such as 27.916666666666668
        return _Draft(entry["question"], {**entry, "steps": steps})

    def _finish(self, draft):
        return self._example(draft.key, "\n".join(draft.data["steps"]), draft.data["answer"])

    def check(self, meta, answer):
        entry = {"answer": meta["answer"], "metadata": {}}
        return _scorer(self.rg_name).score_answer(answer, entry) == 1.0


class Countdown(_ReasoningGymFamily):
    """Reach a target with all the given numbers and + - * /; steps evaluate the found expression one operation
    at a time. Scored by reasoning-gym (uses exactly the given numbers and equals the target)."""

    name = rg_name = "countdown"
    LEVELS = {
        "easy": dict(min_numbers=3, max_numbers=3, max_value=20, min_target=1, max_target=50),
        "medium": dict(min_numbers=3, max_numbers=4, max_value=50, min_target=10, max_target=200),
        "hard": dict(min_numbers=4, max_numbers=4, max_value=100, min_target=100, max_target=999),
    }
    DEFAULT_LEVEL = "medium"

    def _draw(self, sub_seed):
        entry = self._entry(sub_seed, **self.settings)
        numbers, target = entry["metadata"]["numbers"], entry["metadata"]["target"]
        expression = ast.unparse(ast.parse(entry["answer"], mode="eval"))  # uniform spacing: `21 * 37 / 3`
        value, steps = _evaluate_with_steps(expression)
        if value != target or any("/" in s.split("=")[1] for s in steps):  # keep integer intermediates only
            return None
        key = f"{sorted(numbers)} -> {target}"
        return _Draft(key, {"entry": entry, "expression": expression, "steps": steps})

    def _finish(self, draft):
        entry = draft.data["entry"]
        prompt = entry["question"].split("\n\nFinal answer format instructions")[0].strip()
        prompt += "\nGive the expression as the answer."
        meta = {"numbers": entry["metadata"]["numbers"], "target": entry["metadata"]["target"]}
        return self._example(prompt, "\n".join(draft.data["steps"]), draft.data["expression"], **meta)

    def check(self, meta, answer):
        entry = {"answer": meta["answer"], "metadata": {"numbers": meta["numbers"], "target": meta["target"]}}
        return _scorer(self.rg_name).score_answer(answer, entry) == 1.0


class Retrieval(Family):
    """Long-context lookup: facts `The code of <name> is <5-digit number>.` scattered over seeded filler text,
    the question `What is the code of <name>?` at the end, and distractor facts about other people.

    Length: with a `tokenizer` the prompt is fitted to `context_tokens` tokens of it (within `TOLERANCE`);
    without one, characters are counted at `CHARS_PER_TOKEN` per token, about what the demo's 8K BPE gives on
    this filler.

    `shared_prefix` (training only; held-out sets keep 0): the share of problems in which one distractor's code
    starts with the same 1-4 digits as the asked code. The demo model copies a code digit by digit and, where
    another code shares its first digit, half the time goes on with that code instead (session 10's diagnosis,
    scripts/retrieval_diagnosis.py); these problems make the rest of the code depend on where it was found.

    `shared_all` (training only): a shared-prefix problem gives every distractor a code sharing 1-4 of the asked
    code's first digits (each its own length), so that copying on from the previous digit is ambiguous at every
    shared digit and only the name tells the codes apart.

    `distractors` (training only): (lo, hi) overrides the level's number of distractor facts, drawn uniformly;
    more distractors make more of the codes share the asked code's first digit by chance (with 8, 61% of problems)."""

    name = "retrieval"
    LEVELS = {
        "easy": dict(distractors=(1, 1), related_names=False),
        "medium": dict(distractors=(1, 3), related_names=False),
        "hard": dict(distractors=(3, 3), related_names=True),
    }
    DEFAULT_LEVEL = "medium"
    MAX_DISTRACTORS = 32
    CHARS_PER_TOKEN = 5.0
    TOLERANCE = 0.03
    HEAD = "Read the text below and answer the question at the end.\n\n"

    def __init__(
        self,
        level: str | None = None,
        tokenizer=None,
        context_tokens: int = 2048,
        shared_prefix: float = 0.0,
        distractors: tuple[int, int] | None = None,
        shared_all: bool = False,
    ):
        super().__init__(level)
        if not 0.0 <= shared_prefix <= 1.0:
            raise ValueError(f"retrieval: shared_prefix {shared_prefix} must be in [0, 1]")
        if distractors is not None:
            lo, hi = distractors
            if not 1 <= lo <= hi <= self.MAX_DISTRACTORS:
                raise ValueError(
                    f"retrieval: distractors {lo},{hi} must satisfy 1 <= lo <= hi <= {self.MAX_DISTRACTORS}"
                )
            self.settings = {**self.settings, "distractors": (lo, hi)}
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.shared_prefix = shared_prefix
        self.shared_all = shared_all

    def _draw(self, sub_seed):
        rng = random.Random(sub_seed)
        first, last = person_name(rng)
        lo, hi = self.settings["distractors"]
        others: list[tuple[str, str]] = []
        count = rng.randint(lo, hi)
        while len(others) < count:
            other = person_name(rng)
            if self.settings["related_names"]:  # share the first or the family name with the asked person
                other = (first, other[1]) if rng.random() < 0.5 else (other[0], last)
            if other != (first, last) and other not in others:
                others.append(other)
        codes = rng.sample(range(10000, 100000), 1 + len(others))
        # no draw at 0: held-out sets stay as they were
        if self.shared_prefix and rng.random() < self.shared_prefix:
            if self.shared_all:
                for i in range(1, len(codes)):
                    codes[i] = _code_sharing_prefix(rng, codes, rng.randint(1, 4))
            else:  # (the right side draws first: the stream of runs 4-6)
                codes[rng.randrange(1, len(codes))] = _code_sharing_prefix(rng, codes, rng.randint(1, 4))
        names = [f"{first} {last}"] + [f"{a} {b}" for a, b in others]
        return _Draft(f"{names[0]}={codes[0]}", {"names": names, "codes": codes, "seed": rng.getrandbits(64)})

    def _finish(self, draft, context_tokens: int | None = None):
        context_tokens = context_tokens or self.context_tokens
        names, codes = draft.data["names"], draft.data["codes"]
        rng = random.Random(draft.data["seed"])
        facts = [f"The code of {n} is {c}." for n, c in zip(names, codes)]
        rng.shuffle(facts)
        places = [rng.random() for _ in facts]  # relative positions in the filler
        question = f"\n\nQuestion: What is the code of {names[0]}?"
        filler = FillerStream(rng)

        def render(n: int) -> str:
            parts = [self.HEAD]
            slots = sorted(zip((int(p * n) for p in places), facts))
            for i, (s, sep) in enumerate(filler.sentences(n)):
                while slots and slots[0][0] == i:
                    parts.append(slots.pop(0)[1] + " ")
                parts.append(s + sep)
            parts.extend(f + " " for _, f in slots)
            return "".join(parts).rstrip() + question

        fixed_chars = len(self.HEAD) + len(question) + sum(len(f) + 1 for f in facts)
        n = filler.count_for_chars(max(1, int(context_tokens * self.CHARS_PER_TOKEN) - fixed_chars))
        prompt = render(n)
        if self.tokenizer is not None:  # rescale the sentence count by the measured tokens per sentence
            for _ in range(6):
                length = len(self.tokenizer.encode(prompt))
                if abs(length - context_tokens) <= self.TOLERANCE * context_tokens:
                    break
                n = max(1, round(n * context_tokens / length))
                prompt = render(n)
        reasoning = f"The text says: The code of {names[0]} is {codes[0]}."
        return self._example(
            prompt, reasoning, str(codes[0]), question.lstrip(), name=names[0], context_tokens=context_tokens
        )

    def check(self, meta, answer):
        return answer.strip() == meta["answer"]


def _code_sharing_prefix(rng: random.Random, codes: list[int], n: int) -> int:
    """A 5-digit code that starts with exactly the first n digits of codes[0] and is none of `codes`."""
    asked = str(codes[0])
    while True:
        nxt = rng.choice([d for d in "0123456789" if d != asked[n]])  # the first digit that differs
        code = int(asked[:n] + nxt + "".join(rng.choice("0123456789") for _ in range(4 - n)))
        if code not in codes:
            return code


FAMILIES: dict[str, type[Family]] = {
    cls.name: cls for cls in (ChainSum, BasicArithmetic, GsmSymbolic, Countdown, Retrieval)
}


def make_family(name: str, level: str | None = None, **kwargs) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; choose from {sorted(FAMILIES)}")
    return FAMILIES[name](level, **kwargs)


def extract_answer(completion: str) -> str | None:
    """The text after the last `Answer:` line start, or None."""
    found = _ANSWER_LINE.findall(completion)
    return found[-1] if found else None


def verify(example_or_meta: Example | dict, completion: str) -> bool:
    """Whether `completion`'s final `Answer: ...` line is right, by the family's verifier."""
    meta = example_or_meta.meta if isinstance(example_or_meta, Example) else example_or_meta
    answer = extract_answer(completion)
    if answer is None or not answer:
        return False
    return _checker(meta["family"]).check(meta, answer)


@functools.cache
def _checker(family: str) -> Family:
    return make_family(family)
