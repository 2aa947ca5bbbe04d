"""Task families for the demo model: procedural problems with short worked steps and a verifier.

Every family has `generate(seed, index) -> Example`, deterministic for (seed, index), and `check(meta, answer)`;
the module-level `verify(example_or_meta, completion)` pulls the last `Answer: ...` line out of a completion
and scores it. Four families wrap reasoning-gym generators and add worked steps a small model can imitate;
`retrieval` (long context) is Kestrel's own, in `kestrel.train.retrieval`.

Difficulty: each family has one knob, `level`, naming a preset in its `LEVELS` table:

    family            easy                          medium                          hard
    chain_sum         3-5 terms, 1-2 digits *       -                               5-8 terms, 2-3 digits
    basic_arithmetic  2-3 terms, 1 digit *          3-4 terms, 1-2 digits           4-6 terms, 2 digits
    gsm_symbolic      solutions of <= 2 steps       <= 3 steps                      any template *
    countdown         3 numbers 1-20, target 1-50   3-4 of 1-50, target 10-200 *    4 of 1-100, target 100-999
    retrieval         1 distractor                  1-3 distractors *               3 distractors sharing a name part

(* = the default level.) Retrieval's other knob is `context_tokens` per call: 2K is easy, 8K medium, 32K hard.

The held-out split and what every family builds on: `kestrel.train.family`; `retrieval`: `kestrel.train.retrieval`.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from fractions import Fraction
from typing import ClassVar

from kestrel.train.family import Draft, Example, Family
from kestrel.train.retrieval import Retrieval

_LONG_DECIMAL = re.compile(r"\d\.\d{4,}")
_ANSWER_LINE = re.compile(r"^\s*Answer:[ \t]*(.*?)\s*$", re.MULTILINE)


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
        return Draft(entry["metadata"]["expression"], entry)

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
        return Draft(entry["metadata"]["expression"], entry)

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
        return Draft(entry["question"], {**entry, "steps": steps})

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
        entry = _countdown_entry(sub_seed, **self.settings)
        numbers, target = entry["metadata"]["numbers"], entry["metadata"]["target"]
        expression = ast.unparse(ast.parse(entry["answer"], mode="eval"))  # uniform spacing: `21 * 37 / 3`
        value, steps = _evaluate_with_steps(expression)
        if value != target or any("/" in s.split("=")[1] for s in steps):  # keep integer intermediates only
            return None
        key = f"{sorted(numbers)} -> {target}"
        return Draft(key, {"entry": entry, "expression": expression, "steps": steps})

    def _finish(self, draft):
        entry = draft.data["entry"]
        prompt = entry["question"].split("\n\nFinal answer format instructions")[0].strip()
        prompt += "\nGive the expression as the answer."
        meta = {"numbers": entry["metadata"]["numbers"], "target": entry["metadata"]["target"]}
        return self._example(prompt, "\n".join(draft.data["steps"]), draft.data["expression"], **meta)

    def check(self, meta, answer):
        entry = {"answer": meta["answer"], "metadata": {"numbers": meta["numbers"], "target": meta["target"]}}
        return _scorer(self.rg_name).score_answer(answer, entry) == 1.0


def _countdown_entry(seed: int, **settings) -> dict:
    """reasoning-gym's `create_dataset("countdown", size=1, seed=seed, **settings)[0]`, the same dict, about 20x
    faster (`_fast_countdown`)."""
    config_cls, dataset_cls = _fast_countdown()
    return dataset_cls(config_cls(seed=seed, size=1, **settings))[0]


@functools.cache
def _fast_countdown():
    """(reasoning-gym's CountdownConfig, its CountdownDataset with the expression search in Python integers).
    reasoning-gym builds every candidate expression in sympy and evaluates it by substitution, about 4 ms a
    problem (three quarters of the demo's data workers' time at 256-1024-token retrieval, session 34). Here the
    candidates are folded left to right in integers, drawing from the generator exactly as reasoning-gym does
    (the numbers, each operator, the shuffled divisor candidates), so each seed gives the same problem, and
    sympy prints each sequence of operators once: 0.2 ms a problem over the same 450 seeds of the three levels
    (tests/train/test_data.py compares the two over many seeds)."""
    _reasoning_gym()
    import sympy
    from reasoning_gym.games.countdown import CountdownConfig, CountdownDataset

    @functools.cache
    def form(ops: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """sympy's printed form of x_0 op x_1 op ..., and the names: it depends on the operators alone."""
        syms = sympy.symbols(f"x_{0}:{len(ops) + 1}")
        expr = syms[0]
        for op, sym in zip(ops, syms[1:]):
            expr = {"+": expr + sym, "-": expr - sym, "*": expr * sym, "/": expr / sym}[op]
        return str(expr), tuple(s.name for s in syms)

    def printed(numbers: list[int], ops: list[str]) -> str:
        """The expression as reasoning-gym prints it: sympy's form, its names replaced by the numbers."""
        text, names = form(tuple(ops))
        for name, number in sorted(zip(names, map(str, numbers)), key=lambda r: -len(r[0])):
            text = text.replace(name, number)  # the longest names first, as reasoning-gym replaces them
        return text

    # exact: a division only where it divides
    fold = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}

    class FastCountdown(CountdownDataset):
        def _generate_expression(self, rng):
            cfg = self.config
            terms = rng.randint(cfg.min_numbers, cfg.max_numbers)
            for _ in range(100):
                numbers = [rng.randint(cfg.min_value, cfg.max_value) for _ in range(terms)]
                value, ops = numbers[0], []
                for i in range(1, terms):
                    op = rng.choice(cfg.operators)
                    if op == "/" and numbers[i] == 0:
                        op = "+"
                    elif op == "/":  # a later number that divides the value so far, else a subtraction
                        remaining = [n for n in numbers[i:] if n != 0]
                        rng.shuffle(remaining)
                        divisor = next((d for d in remaining if value % d == 0), None)
                        if divisor is None:
                            op = "-"
                        else:
                            numbers[i] = divisor
                    value = fold[op](value, numbers[i])
                    ops.append(op)
                if cfg.min_target <= value <= cfg.max_target:
                    return printed(numbers, ops), numbers, value
            raise ValueError("Failed to generate valid expression after 100 attempts")

    return CountdownConfig, FastCountdown


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
