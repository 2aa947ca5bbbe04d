#!/usr/bin/env python3
"""Pick the better of several demo training runs by their `kestrel eval` JSON (scripts/gpu_train_demo.sh
finish writes RUN/eval.json), the way issue 5 judges the demo model:

- a run qualifies when every easy family is at >= 90% and the hardest (countdown) strictly between 20% and 80%;
- among those, the highest retrieval accuracy at 8K with DSA on wins (then at 32K, then 2K).

Prints the chosen run folder on stdout (nothing, exit 1, when none qualifies) and a line per run on stderr.

    python3 scripts/pick_demo_run.py /tmp/run-a /tmp/run-b
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EASY = ("chain_sum", "basic_arithmetic")
HARDEST = "countdown"


def _retrieval(result: dict, length: int) -> float:
    entry = result.get("retrieval", {}).get(str(length), {})  # JSON keys are strings
    return entry.get("dsa", {}).get("accuracy", 0.0)


def judge(result: dict) -> tuple[bool, tuple[float, ...]]:
    """(qualifies, ranking key) of one eval result."""
    families = result.get("families", {})
    acc = {name: families.get(name, {}).get("accuracy", 0.0) for name in (*EASY, HARDEST)}
    ok = all(acc[name] >= 0.9 for name in EASY) and 0.2 < acc[HARDEST] < 0.8
    return ok, tuple(_retrieval(result, n) for n in (8192, 32768, 2048))


def main(runs: list[str]) -> int:
    if not runs:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    best = None
    for run in runs:
        path = Path(run) / "eval.json"
        if not path.is_file():
            print(f"{run}: no eval.json", file=sys.stderr)
            continue
        ok, key = judge(json.loads(path.read_text()))
        print(
            f"{run}: {'qualifies' if ok else 'does not qualify'}, retrieval 8K/32K/2K {key}", file=sys.stderr
        )
        if ok and (best is None or key > best[1]):
            best = (run, key)
    if best is None:
        return 1
    print(best[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
