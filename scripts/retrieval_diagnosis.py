"""Where a model's long-context retrieval fails, on held-out retrieval prompts (CPU or GPU, through the engine).

The answer the model is trained to write is `The text says: The code of <name> is <code>.\\nAnswer: <code>`, so
a wrong answer is one of two failures, measured apart:
  free       the whole answer generated greedily (what `kestrel eval` scores);
  lookup     the asked name written for it (teacher-forced up to `... is`): does the code that follows match?
  name_copy  the asked first name written for it: does the model go on with the right family name?
A model with a good `lookup` and a poor `free` fails at copying the name from the question, not at finding
the fact. Each wrong lookup is also classed by the code it wrote against the prompt's other codes:
  distractor  another person's whole code;
  splice      the right code's first digits, then a distractor's code from just after a digit equal to the last
              one copied (digit-by-digit copying that jumps to the other code at a shared digit);
  other       anything else.
and the lookup accuracy is split by whether a distractor's code shares its first digit with the right one.
  name_swap  does the name steer the copy? For each distractor, at the first digit where its code and the right
             one part (after their shared prefix), the model is given `... of <name> is <shared prefix>` once with
             the asked name and once with the distractor's: it reads the name if it writes each code's own next
             digit; it ignores the name if it writes the same digit both times. Split by the shared prefix's
             length (0: the first digit, the lookup that works; 1+: where the misses are).

    python3 scripts/retrieval_diagnosis.py --model kestrel-demo --num 30 --length 2048 --out diag.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.engine.llm import LLM  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402
from kestrel.train.chat_format import prompt_ids  # noqa: E402
from kestrel.train.data import heldout_examples  # noqa: E402
from kestrel.train.evaluate import _accuracy  # noqa: E402


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _share(flags: list[bool], where: list[bool]) -> float | None:
    picked = [f for f, w in zip(flags, where) if w]
    return sum(picked) / len(picked) if picked else None


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def classify(wrote: str, answer: str, others: list[str]) -> str:
    """right | distractor | splice | other, for the code written after `... is` (the first run of digits; see the
    module docstring). A splice copies the right code's first j digits, then goes on with a distractor's code
    from just after a digit equal to the last one copied."""
    code = (re.findall(r"\d+", wrote) or [""])[0]
    if code == answer:
        return "right"
    if code in others:
        return "distractor"
    for j in range(1, len(code)):
        if code[:j] != answer[:j]:
            break
        rest = code[j:]
        for other in others:
            for i in range(1, len(other)):
                if other[i - 1] == code[j - 1] and other[i : i + len(rest)] == rest:
                    return "splice"
    return "other"


def _next_digit(text: str) -> str:
    found = re.search(r"\d", text)
    return found.group(0) if found else ""


def name_swap(llm: LLM, tok, examples) -> dict:
    """The name_swap measure (module docstring), per shared-prefix length: how often each name's own next digit
    is written, and how often the same digit is written under both names."""
    rows = []  # the shared prefix length of each (asked, distractor) pair
    prompts = []
    for ex in examples:
        facts = re.findall(r"The code of ([^.]*?) is (\d+)\.", ex.prompt)
        for name, code in facts:
            if name == ex.meta["name"] or code == ex.answer:
                continue
            j = _shared_prefix(code, ex.answer)
            head = prompt_ids(tok, ex)
            for who, right in ((ex.meta["name"], ex.answer), (name, code)):
                text = f"The text says: The code of {who} is" + (f" {ex.answer[:j]}" if j else "")
                prompts.append((head + tok.encode(text), right[j]))
            rows.append(j)
    outs = _greedy(llm, [p for p, _ in prompts], 3)
    digits = [_next_digit(o) for o in outs]
    result: dict = {}
    for i, j in enumerate(rows):
        d_asked, d_other = digits[2 * i], digits[2 * i + 1]  # written after the asked / the distractor's name
        r_asked, r_other = prompts[2 * i][1], prompts[2 * i + 1][1]  # each code's own next digit
        key = "shared_0" if j == 0 else "shared_1+"
        entry = result.setdefault(
            key, {"pairs": 0, "asked_name_right": 0, "distractor_name_right": 0, "same_digit": 0}
        )
        entry["pairs"] += 1
        entry["asked_name_right"] += d_asked == r_asked
        entry["distractor_name_right"] += d_other == r_other
        entry["same_digit"] += d_asked == d_other
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="kestrel-demo")
    ap.add_argument("--num", type=int, default=30)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, max_running_requests=8)
    engine, tok = llm.engine, llm.tokenizer
    examples = heldout_examples("retrieval", args.num, tokenizer=tok, context_tokens=args.length)

    free = _accuracy(engine, examples, 32, f"retrieval@{args.length}")
    forced = [
        prompt_ids(tok, ex) + tok.encode(f"The text says: The code of {ex.meta['name']} is")
        for ex in examples
    ]
    codes = _greedy(llm, forced, 7)
    others = [
        [c for c in re.findall(r"The code of [^.]*? is (\d+)\.", ex.prompt) if c != ex.answer]
        for ex in examples
    ]
    kinds = [classify(text, ex.answer, o) for text, ex, o in zip(codes, examples, others)]
    lookup = [kind == "right" for kind in kinds]  # one reading of the written code for both
    shares = [any(o[:1] == ex.answer[:1] for o in os_) for ex, os_ in zip(examples, others)]
    firsts = [ex.meta["name"].split(" ", 1) for ex in examples]
    names = _greedy(llm, [prompt_ids(tok, ex) + tok.encode(f"The text says: The code of {first}")
                             for ex, (first, _) in zip(examples, firsts)], 6)  # fmt: skip
    copied = [text.startswith(f" {family} is") for text, (_, family) in zip(names, firsts)]
    result = {
        "command": " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "device": str(engine.device),
        "model": args.model,
        "length": args.length,
        "n": len(examples),
        "free_accuracy": free["accuracy"],
        "free_wrong_samples": free["wrong_samples"],
        "lookup_accuracy_given_the_name": sum(lookup) / len(lookup),
        "lookup_wrong_kinds": {k: kinds.count(k) for k in ("distractor", "splice", "other")},
        "lookup_wrong_samples": [
            {"answer": ex.answer, "wrote": text.strip(), "others": o, "kind": k}
            for ex, text, o, k in zip(examples, codes, others, kinds)
            if k != "right"
        ][:12],
        "lookup_accuracy_first_digit_shared": _share(lookup, shares),
        "lookup_accuracy_first_digit_not_shared": _share(lookup, [not s for s in shares]),
        "first_digit_shared": sum(shares),
        "name_copy_accuracy": sum(copied) / len(copied),
        "name_copy_samples": [
            {"asked": ex.meta["name"], "wrote": text} for ex, text in zip(examples[:5], names)
        ],
        # the family names the tokenizer splits (copying those takes an induction step per piece)
        "multi_token_family_names": sum(len(tok.encode(" " + family)) > 1 for _, family in firsts),
        "name_copy_accuracy_multi_token": _share(copied, [len(tok.encode(" " + f)) > 1 for _, f in firsts]),
        "name_swap": name_swap(llm, tok, examples),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
