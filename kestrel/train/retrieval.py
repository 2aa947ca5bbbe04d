"""The demo model's long-context family: `retrieval`, key-value facts scattered over seeded filler text with the
question at the end (see `Retrieval`). Registered with the others in `kestrel.train.tasks`."""

from __future__ import annotations

import random

from kestrel.train.family import Draft, Family
from kestrel.train.filler import FillerStream, person_name


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
        return Draft(f"{names[0]}={codes[0]}", {"names": names, "codes": codes, "seed": rng.getrandbits(64)})

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
    """A 5-digit code that starts with exactly the first n digits of codes[0] and is none of `codes`; with n
    digits' every code taken (only 9 share 4 digits: 10+ distractors at --retrieval-shared-all), one digit fewer
    (the loop below looked for a free one forever)."""
    asked = str(codes[0])
    while n > 1 and 9 * 10 ** (4 - n) < len(codes) and _all_taken(asked, n, set(codes)):
        n -= 1
    while True:
        nxt = rng.choice([d for d in "0123456789" if d != asked[n]])  # the first digit that differs
        code = int(asked[:n] + nxt + "".join(rng.choice("0123456789") for _ in range(4 - n)))
        if code not in codes:
            return code


def _all_taken(asked: str, n: int, codes: set[int]) -> bool:
    """Whether every 5-digit code that starts with exactly the first n digits of `asked` is in `codes`."""
    rest = 4 - n
    return all(
        int(asked[:n] + d + f"{tail:0{rest}d}" if rest else asked[:n] + d) in codes
        for d in "0123456789"
        if d != asked[n]
        for tail in range(10**rest)
    )
