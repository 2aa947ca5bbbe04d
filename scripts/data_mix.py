"""What a training batch of `kestrel train` holds for a data recipe: documents per family, their share of the
batch's tokens and of its loss tokens, and the retrieval problems (the lookups the demo model must learn) per
batch. CPU only, from the data pipeline alone (no model), so recipes can be compared before a GPU run.

    python3 scripts/data_mix.py --recipe "run7=256,256,512,512,1024,2048,8192@1" \
        --recipe "short=256,256,512,512,1024@1" --batches 6 --out bench/results/data-mix.json

A recipe is NAME=LENGTHS@RETRIEVAL_WEIGHT (the --retrieval-lengths and --retrieval-weight of `kestrel train`);
the other knobs are run 7's (--retrieval-shared-prefix 0.5 --retrieval-distractors 1,8 --retrieval-shared-all,
8 rows x 8704 tokens, seed 7, the shipped tokenizer). --rate-seconds S also times each recipe's batches, as
the trainer's prefetch thread takes them (--workers N worker processes): the tokens a second the data can feed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.config import TrainConfig  # noqa: E402
from kestrel.tokenizer import load_tokenizer  # noqa: E402
from kestrel.train.data import PackedBatches  # noqa: E402
from kestrel.train.trainer import mixture_config  # noqa: E402


def parse_recipe(text: str) -> tuple[str, tuple[int, ...], float]:
    """NAME=L1,L2,...@WEIGHT -> (name, lengths, weight)."""
    try:
        name, rest = text.split("=", 1)
        lengths, weight = rest.split("@", 1)
        parsed = tuple(int(n) for n in lengths.split(",")), float(weight)
    except ValueError:
        raise SystemExit(
            f"--recipe {text!r}: expected NAME=L1,L2,...@WEIGHT, e.g. short=256,512,1024@1"
        ) from None
    if not name or not parsed[0] or min(parsed[0]) < 1 or parsed[1] <= 0:
        raise SystemExit(f"--recipe {text!r}: a name, positive lengths and a positive weight are needed")
    return name, *parsed


def recipe_batches(
    lengths: tuple[int, ...], weight: float, tokenizer, rows: int, row_len: int, workers: int = 0
) -> PackedBatches:
    """The batches `kestrel train` draws with this recipe and run 7's other retrieval options (tokenizer: a
    folder where workers > 0)."""
    cfg = TrainConfig(
        out_dir="unused",
        batch_rows=rows,
        row_len=row_len,
        seed=7,
        retrieval_lengths=lengths,
        retrieval_weight=weight,
        retrieval_shared_prefix=0.5,
        retrieval_distractors=(1, 8),
        retrieval_shared_all=True,
    )
    return PackedBatches(tokenizer, rows, row_len, mixture_config(cfg), seed=cfg.seed, num_workers=workers)


def batch_rate(data: PackedBatches, seconds: float) -> dict:
    """Tokens (padding included) a second the batches come at, after the first (the workers' start)."""
    next(data)
    started, batches = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        next(data)
        batches += 1
    elapsed = time.perf_counter() - started
    return {
        "batches": batches,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(batches * data.batch_size * data.seq_len / elapsed),
    }


def batch_mix(
    lengths: tuple[int, ...], weight: float, batches: int, tokenizer, rows: int, row_len: int
) -> dict:
    data = recipe_batches(lengths, weight, tokenizer, rows, row_len)
    names = data.family_names
    docs, tokens, loss_tokens = ({n: 0 for n in names} for _ in range(3))
    all_tokens = all_loss = 0
    for _ in range(batches):
        batch = next(data)
        family, mask = batch.family_ids.flatten(), batch.loss_mask.flatten()
        cu = batch.cu_seqlens.tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            f = int(family[start])
            if f >= 0:
                docs[names[f]] += 1
                tokens[names[f]] += end - start
        for f, name in enumerate(names):
            loss_tokens[name] += int((mask & (family == f)).sum())
        all_tokens += family.numel()
        all_loss += int(mask.sum())
    return {
        "retrieval_lengths": list(lengths),
        "retrieval_weight": weight,
        "documents_per_batch": {n: round(docs[n] / batches, 1) for n in names},
        "token_share": {n: round(tokens[n] / all_tokens, 3) for n in names},
        "loss_token_share": {n: round(loss_tokens[n] / max(all_loss, 1), 3) for n in names},
        "loss_tokens_per_batch": round(all_loss / batches),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--recipe", action="append", required=True, help="NAME=L1,L2,...@RETRIEVAL_WEIGHT")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--row-len", type=int, default=8704)
    ap.add_argument("--tokenizer", default="kestrel/data/kestrel-demo")
    ap.add_argument("--rate-seconds", type=float, default=0, help="also time each recipe's batches this long")
    ap.add_argument("--workers", type=int, default=0, help="data worker processes for --rate-seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.batches < 1:
        ap.error("--batches must be at least 1")
    if args.rate_seconds < 0 or args.workers < 0:
        ap.error("--rate-seconds and --workers must not be negative")
    tokenizer = load_tokenizer(args.tokenizer)
    result = {
        "command": "python3 scripts/data_mix.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "rows": args.batch_rows,
        "row_len": args.row_len,
        "batches": args.batches,
        "recipes": {},
    }
    for text in args.recipe:
        name, lengths, weight = parse_recipe(text)
        mix = batch_mix(lengths, weight, args.batches, tokenizer, args.batch_rows, args.row_len)
        result["recipes"][name] = mix
        if args.rate_seconds:
            data = recipe_batches(
                lengths, weight, args.tokenizer, args.batch_rows, args.row_len, args.workers
            )
            try:
                mix["rate"] = {"workers": args.workers, **batch_rate(data, args.rate_seconds)}
            finally:
                data.close()
            print(
                f"{name}: {mix['rate']['tokens_per_s'] / 1e3:.0f} K tokens/s with {args.workers} workers",
                flush=True,
            )
        docs = mix["documents_per_batch"]
        print(
            f"{name}: {sum(docs.values()):.0f} documents a batch, {docs.get('retrieval', 0):.1f} retrieval "
            f"({mix['token_share'].get('retrieval', 0):.0%} of the tokens, "
            f"{mix['loss_token_share'].get('retrieval', 0):.0%} of the loss tokens)",
            flush=True,
        )
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
