"""Structured outputs on the CPU: what a grammar costs (its compile, then each token's mask) against xgrammar
(vLLM's and SGLang's default backend) in the same run, on the same vocabulary and the same tokens, and whether the
two allow the same tokens at each step.

For each vocabulary (the shipped model's 4,468-token BPE padded to 5,120 ids, and a synthetic 150,000-token one:
the 256 bytes and seeded random strings over a JSON-ish alphabet) and each case (JSON schemas, JSON mode, a
regex): Kestrel's grammar is compiled (`Grammar`: the pattern's automaton and its probe walk), a token sequence
is drawn from its masks (seeded; uniform over the allowed tokens, EOS once allowed with probability 1/2), and that
sequence is replayed twice, timing each token's mask and advance: cold (each state's mask made on first sight)
then warm (kept). xgrammar compiles the same schema (compact JSON: `any_whitespace=False`; JSON mode is its
built-in JSON grammar, any value) and replays the same sequence (`fill_next_token_bitmask`, `accept_token`); its
masks are compared with Kestrel's row by row. Without xgrammar installed (`pip install xgrammar`) only Kestrel's
side runs.

    ./run python scripts/bench_grammar.py --out bench/results/<date>-cpu-grammar.json [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.engine.sampling_params import StructuredOutputsParams  # noqa: E402
from kestrel.grammar.tokens import Grammar, Vocabulary  # noqa: E402
from kestrel.presets import shipped_model_dir  # noqa: E402
from kestrel.tokenizer import load_tokenizer  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 4},
        "active": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age"],
}
ORDER = {  # a pydantic-style schema: nested models through $defs
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
                "qty": {"type": "integer"},
            },
            "required": ["sku", "qty"],
        }
    },
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 3},
        "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]},
    },
    "required": ["id", "items", "note"],
}
CASES = {
    "schema_person": {"json": PERSON},
    "schema_order": {"json": ORDER},
    "json_object": {"json_object": True},
    "regex_phone": {"regex": r"\+?[0-9]{1,3} [0-9]{3}-[0-9]{3}-[0-9]{4}"},
}


def vocabularies(quick: bool) -> dict[str, Vocabulary]:
    found = {}
    demo = shipped_model_dir()
    if demo is not None:
        tok = load_tokenizer(str(demo))
        found["demo_bpe_5120"] = Vocabulary.of(tok, 5120, tok.eos_token_ids)
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.:;{}[]\"'-_@+/\\"
    size = 20_000 if quick else 150_000
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    while len(tokens) < size - 1:
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 10))).encode()
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    found[f"synthetic_{size // 1000}k"] = Vocabulary(tokens + [b""], eos_ids=(size - 1,))
    return found


def draw(grammar: Grammar, seed: int, limit: int) -> list[int]:
    """A token sequence the grammar allows: uniform over the allowed tokens, EOS with probability 1/2 once allowed."""
    rng = np.random.default_rng(seed)
    eos = set(grammar.vocab.eos_ids)
    state, out = grammar.start, []
    for _ in range(limit):
        allowed = np.flatnonzero(grammar.allowed(state))
        ends = [i for i in allowed.tolist() if i in eos]
        if ends and (len(ends) == len(allowed) or rng.random() < 0.5):
            out.append(ends[0])
            break
        others = allowed[~np.isin(allowed, list(eos))]
        token = int(rng.choice(others))
        out.append(token)
        state = grammar.advance(state, token)
    return out


def replay_kestrel(grammar: Grammar, tokens: list[int]) -> tuple[list[float], list[np.ndarray]]:
    state, times, masks = grammar.start, [], []
    for token in tokens:
        start = time.perf_counter()
        mask = grammar.allowed(state)
        state = grammar.advance(state, token)
        times.append(time.perf_counter() - start)
        masks.append(mask)
    return times, masks


def summary(times: list[float]) -> dict:
    us = [t * 1e6 for t in times]
    return {"mean_us": statistics.fmean(us), "median_us": statistics.median(us), "max_us": max(us)}


def xgrammar_side(vocab: Vocabulary, spec: dict, tokens: list[int], ours: list[np.ndarray]) -> dict:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo(
        vocab.token_bytes,
        vocab_type=xgr.VocabType.RAW,
        vocab_size=vocab.size,
        stop_token_ids=list(vocab.eos_ids),
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    if "json" in spec:
        compiled = compiler.compile_json_schema(
            json.dumps(spec["json"]), any_whitespace=False, separators=(",", ":")
        )
    elif "regex" in spec:
        compiled = compiler.compile_regex(spec["regex"])
    else:
        compiled = compiler.compile_builtin_json_grammar()
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, vocab.size)
    out = {"compile_ms": compile_s * 1e3, "version": importlib.metadata.version("xgrammar")}
    for run in ("cold", "warm"):
        matcher = xgr.GrammarMatcher(compiled)
        times, agree, rejected = [], 0, None
        for step, token in enumerate(tokens):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            accepted = matcher.accept_token(token)
            times.append(time.perf_counter() - start)
            if run == "cold":
                theirs = _unpack(bitmask[0], vocab.size)
                same = bool(np.array_equal(theirs, ours[step]))
                agree += same
                if not same and "first_difference" not in out:
                    out["first_difference"] = _difference(vocab, tokens[:step], ours[step], theirs)
            if not accepted:
                rejected = step
                break
        out[run] = summary(times)
        if run == "cold":
            out["masks_equal_to_kestrels"] = f"{agree}/{len(tokens)}"
            out["rejected_kestrels_token_at"] = rejected
    del torch
    return out


def _difference(vocab: Vocabulary, before: list[int], ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Where the two first disagree: the text so far, and a few tokens only one of them allows."""
    show = lambda ids: [vocab.token_bytes[i].decode("utf-8", "backslashreplace") for i in ids[:6]]  # noqa: E731
    only_ours, only_theirs = np.flatnonzero(ours & ~theirs), np.flatnonzero(theirs & ~ours)
    return {
        "step": len(before),
        "text_before": b"".join(vocab.token_bytes[t] for t in before)[-40:].decode(
            "utf-8", "backslashreplace"
        ),
        "only_kestrel": {"count": len(only_ours), "some": show(only_ours)},
        "only_xgrammar": {"count": len(only_theirs), "some": show(only_theirs)},
    }


def _unpack(words, size: int) -> np.ndarray:
    """xgrammar's int32 bitmask row as [size] bool."""
    raw = words.numpy().astype(np.uint32).view(np.uint8)
    return np.unpackbits(raw, bitorder="little")[:size].astype(bool)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    ap.add_argument(
        "--quick", action="store_true", help="a 20,000-token synthetic vocabulary, short sequences"
    )
    ap.add_argument("--tokens", type=int, default=300, help="the longest token sequence a case draws")
    args = ap.parse_args()
    try:
        import xgrammar  # noqa: F401

        peer = True
    except ImportError:
        peer = False
        print("xgrammar is not installed: Kestrel's side only", file=sys.stderr)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "cases": {},
    }
    limit = 60 if args.quick else args.tokens
    for vname, vocab in vocabularies(args.quick).items():
        for cname, spec in CASES.items():
            pattern = StructuredOutputsParams(**spec).pattern
            start = time.perf_counter()
            grammar = Grammar(pattern, vocab)
            compile_ms = (time.perf_counter() - start) * 1e3
            tokens = draw(
                Grammar(pattern, vocab), seed=1, limit=limit
            )  # (a grammar of its own: `grammar` stays cold)
            cold, masks = replay_kestrel(grammar, tokens)
            warm, _ = replay_kestrel(grammar, tokens)
            text = b"".join(vocab.token_bytes[t] for t in tokens).decode("utf-8", errors="replace")
            case = {
                "vocab_size": vocab.size,
                "tokens": len(tokens),
                "text": text[:200],
                "kestrel": {
                    "compile_ms": compile_ms,
                    "states": grammar.automaton.num_states,
                    "cold": summary(cold),
                    "warm": summary(warm),
                },
            }
            if peer:
                case["xgrammar"] = xgrammar_side(vocab, spec, tokens, masks)
            result["cases"][f"{vname}/{cname}"] = case
            k = case["kestrel"]
            line = (
                f"{vname:16} {cname:14} {len(tokens):4d} tokens  kestrel: compile {k['compile_ms']:8.1f} ms, "
                f"cold {k['cold']['mean_us']:8.0f} us/token, warm {k['warm']['mean_us']:6.0f}"
            )
            if peer:
                x = case["xgrammar"]
                line += (
                    f" | xgrammar: compile {x['compile_ms']:8.1f} ms, cold {x['cold']['mean_us']:6.0f}, "
                    f"warm {x['warm']['mean_us']:6.0f}; same masks {x['masks_equal_to_kestrels']}"
                )
            print(line, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
