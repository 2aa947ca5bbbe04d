"""The bodies of `kestrel train` and `kestrel eval` (the parser is in `kestrel.serve.cli`); the trainer and
the evaluator are imported when the command runs."""

from __future__ import annotations

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

    check_writable(args.out, "--out")
    cfg = EvalConfig(
        model=args.model,
        num_per_family=args.num,
        num_retrieval=args.num_retrieval,
        retrieval_lengths=_lengths(args.retrieval_lengths),
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dense_contrast=not args.no_dense_contrast,
    )

    def save(result: dict) -> None:  # after each family and length: a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(result, indent=2))

    result = evaluate(cfg, on_progress=save)
    save(result)
    print(format_table(result))
    return 0
