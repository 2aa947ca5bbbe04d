"""`kestrel train` and `kestrel eval`: their arguments (`add_train_parsers`, called by `kestrel.serve.cli`'s
parser) and their bodies; the trainer and the evaluator are imported when the command runs."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kestrel.serve import arg_types
from kestrel.utils.errors import KestrelError
from kestrel.utils.paths import check_writable


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _lengths(text: str) -> tuple[int, ...]:
    """--retrieval-lengths: comma-separated token counts."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise KestrelError(
            f"--retrieval-lengths: expected comma-separated token counts, got {text!r}"
        ) from None
    if not values:
        raise KestrelError(f"--retrieval-lengths: expected at least one token count, got {text!r}")
    if any(v < 1 for v in values):
        raise KestrelError(f"--retrieval-lengths: token counts must be positive, got {text!r}")
    return values


def _as_flags(message: str, args) -> str:
    """A TrainConfig or trainer message in the flags that set the fields it names: `row_len` is `--row-len`, and
    `lr must ...` is `--lr must ...` (a field with no flag, or a word of the text, stays as it is)."""
    one_word = r"|^[a-z]+(?= must )|(?<=; )[a-z]+(?= must )"  # TrainConfig's one-word fields, where they fail
    return arg_types.as_flags(message, args, pattern=arg_types.FIELD_NAMES + one_word)


def cmd_train(args) -> int:
    import json

    from kestrel.train.trainer import Trainer

    if args.out.exists() and not args.out.is_dir():  # (the mkdir's "[Errno 17] File exists" named no option)
        raise KestrelError(f"--out {args.out}: exists and is not a folder (the run's folder)")
    created = not args.out.exists()
    try:
        trainer = Trainer(_train_config(args))
    except (KestrelError, ValueError) as e:
        if created and args.out.is_dir() and not any(args.out.iterdir()):  # (not an empty folder left behind)
            args.out.rmdir()
        raise KestrelError(_as_flags(str(e), args)) from None
    # resumed at its last step (the trainer said so): the run's folder and summary stay as they are
    if trainer.done:
        return 0
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop saves like Ctrl-C
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        kept = (Path(args.out) / "checkpoint").is_dir()
        where = (
            f"checkpoint in {args.out}/checkpoint. The same command resumes from it"
            if kept
            else "no checkpoint"
        )
        print(f"[kestrel] stopped at step {trainer.step}; {where}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    (Path(args.out) / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(
        f"[kestrel] checkpoint in {args.out}/checkpoint, loss curve in {args.out}/loss.png", file=sys.stderr
    )
    return 0


def _train_config(args):
    from kestrel.config import TrainConfig

    return TrainConfig(
        out_dir=str(args.out),
        model=args.model,
        tokenizer=args.tokenizer,
        seed=args.seed,
        steps=args.steps,
        batch_rows=args.batch_rows,
        grad_accum=args.grad_accum,
        row_len=args.row_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        dsa_dense_steps=args.dsa_dense_steps,
        retrieval_lengths=_lengths(args.retrieval_lengths),
        retrieval_weight=args.retrieval_weight,
        retrieval_shared_prefix=args.retrieval_shared_prefix,
        retrieval_distractors=args.retrieval_distractors,
        retrieval_shared_all=args.retrieval_shared_all,
        retrieval_loss_weight=args.retrieval_loss_weight,
        checkpoint_every=args.checkpoint_every,
        time_budget_s=args.time_budget_s,
        device=args.device,
        data_workers=args.data_workers,
    )


def cmd_eval(args) -> int:
    import json

    from kestrel.train.evaluate import EvalConfig, evaluate, format_table

    # a finished evaluation takes minutes to hours: replaced only when asked (it was, without a word)
    check_writable(args.out, "--out", overwrite=args.overwrite)
    cfg = EvalConfig(
        model=args.model,
        num_per_family=args.num,
        num_retrieval=args.num_retrieval,
        retrieval_lengths=_lengths(args.retrieval_lengths),
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dense_contrast=not args.no_dense_contrast,
    )

    def save(result: dict, complete: bool = False) -> None:
        """After each family and length: a run cut short keeps what it measured, marked `"complete": false`; the
        file is replaced whole (a rename), never left half-written."""
        if args.out:
            part = args.out.with_name(args.out.name + ".part")
            part.write_text(json.dumps({**result, "complete": complete}, indent=2))
            part.replace(args.out)

    result = evaluate(cfg, on_progress=save)
    save(result, complete=True)
    print(format_table(result))
    return 0


def add_train_parsers(sub: argparse._SubParsersAction) -> None:
    """The `train` and `eval` subcommands' arguments."""
    t = sub.add_parser("train", help="train a model on the procedural task mixture (resumes from --out)")
    t.add_argument(
        "--out",
        required=True,
        type=arg_types.path,
        help="run folder: checkpoint/, loss.png, trainer_state.pt",
    )
    t.add_argument(
        "--model", default="demo", help="preset to start from (random init) or a checkpoint folder"
    )
    t.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder (default: a --model checkpoint's own, else a BPE trained into <out>/tokenizer)",
    )
    t.add_argument("--steps", type=arg_types.positive_int, default=1000, help="optimizer steps in all")
    t.add_argument(
        "--batch-rows", type=arg_types.positive_int, default=16, help="rows (packed documents) a batch"
    )
    t.add_argument(
        "--grad-accum",
        type=arg_types.positive_int,
        default=1,
        help="batches of --batch-rows rows per optimizer step, each a forward and backward of its own (default 1)",
    )
    t.add_argument("--row-len", type=arg_types.positive_int, default=4096, help="tokens a row")
    t.add_argument(
        "--lr", type=float, default=3e-3, help="peak learning rate (linear warm-up, then cosine decay)"
    )
    t.add_argument(
        "--warmup-steps", type=int, default=100, help="steps of the learning rate's linear warm-up"
    )
    t.add_argument("--dsa-dense-steps", type=int, default=200, help="dense warm-up steps before sparse DSA")
    t.add_argument(
        "--retrieval-lengths", default="2048", help="comma-separated context lengths of retrieval docs"
    )
    t.add_argument(
        "--retrieval-weight",
        type=arg_types.non_negative_float,
        default=0.1,
        help="weight of the retrieval family in the draw, against 1.0 per arithmetic family (default 0.1)",
    )
    t.add_argument(
        "--retrieval-shared-prefix",
        type=arg_types.share,
        default=0.0,
        help="share (0-1) of retrieval problems in which a distractor's code starts with the asked code's first "
        "1-4 digits (default 0)",
    )
    t.add_argument(
        "--retrieval-distractors",
        type=arg_types.int_range,
        default=None,
        metavar="LO,HI",
        help="distractor facts per retrieval problem, drawn from LO..HI (default: the medium level's 1,3)",
    )
    t.add_argument(
        "--retrieval-shared-all",
        action="store_true",
        help="in a shared-prefix problem (--retrieval-shared-prefix) every distractor's code shares 1-4 of the "
        "asked code's first digits, not one distractor's",
    )
    t.add_argument(
        "--retrieval-loss-weight",
        type=arg_types.positive_float,
        default=1.0,
        help="weight of the retrieval documents' loss tokens in the mean loss, against 1.0 for the other families "
        "(default 1.0); unlike --retrieval-weight it draws no more documents",
    )
    t.add_argument(
        "--checkpoint-every",
        type=arg_types.positive_int,
        default=500,
        help="save a checkpoint every this many steps",
    )
    t.add_argument(
        "--time-budget-s",
        type=arg_types.positive_float,
        default=None,
        help="stop and checkpoint after this many seconds of training",
    )
    t.add_argument(
        "--data-workers",
        type=arg_types.non_negative_int,
        default=0,
        help="processes that make the batches (0: the training process makes them)",
    )
    t.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    t.add_argument("--seed", type=arg_types.seed, default=0, help="seed of the weights and the data")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out accuracy per task family and retrieval by context length")
    e.add_argument(
        "--model", required=True, help="checkpoint folder or preset (kestrel-demo: the shipped model)"
    )
    e.add_argument("--num", type=arg_types.positive_int, default=200, help="problems per family")
    e.add_argument(
        "--num-retrieval",
        type=arg_types.positive_int,
        default=50,
        help="retrieval problems per context length",
    )
    e.add_argument(
        "--retrieval-lengths",
        default="2048,8192,32768",
        help="comma-separated context lengths of retrieval docs",
    )
    e.add_argument(
        "--max-new-tokens", type=arg_types.positive_int, default=256, help="tokens an answer has at most"
    )
    e.add_argument("--no-dense-contrast", action="store_true", help="skip the dense-attention retrieval runs")
    e.add_argument(
        "--out",
        type=arg_types.path,
        default=None,
        help="write the results as JSON here (an existing file: --overwrite)",
    )
    e.add_argument("--overwrite", action="store_true", help="replace the file already at --out")
    e.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    e.set_defaults(func=cmd_eval)
