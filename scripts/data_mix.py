"""What a training batch of `kestrel train` holds for a data recipe: documents per family, their share of the
batch's tokens and of its loss tokens, and the retrieval problems (the lookups the demo model must learn) per
batch. CPU only, from the data pipeline alone (no model), so recipes can be compared before a GPU run.

    python3 scripts/data_mix.py --recipe "run7=256,256,512,512,1024,2048,8192@1" \
        --recipe "short=256,256,512,512,1024@1" --batches 6 --out bench/results/data-mix.json

A recipe is NAME=LENGTHS@RETRIEVAL_WEIGHT (the --retrieval-lengths and --retrieval-weight of `kestrel train`);
the other knobs are run 7's (--retrieval-shared-prefix 0.5 --retrieval-distractors 1,8 --retrieval-shared-all,
8 rows x 8704 tokens, seed 7, the shipped tokenizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
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


def batch_mix(
    lengths: tuple[int, ...], weight: float, batches: int, tokenizer, rows: int, row_len: int
) -> dict:
    # the mixture `kestrel train` draws from with this recipe and run 7's other retrieval options
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
    data = PackedBatches(tokenizer, rows, row_len, mixture_config(cfg), seed=cfg.seed)
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.batches < 1:
        ap.error("--batches must be at least 1")
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
