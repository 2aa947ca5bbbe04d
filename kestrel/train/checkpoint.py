"""What a training run keeps in its --out folder, and how a run goes on from it.

The folder holds the checkpoint the engine serves (with its tokenizer), the trainer state a resume reads (fp32
master weights, optimizer, data stream, history, training clock), history.json and loss.png, and the BPE trained
for a preset's random weights. The checkpoint and the tokenizer are written whole beside the last ones and renamed
in, the state written beside and renamed over, so a run killed at any point leaves its last ones whole. A resume
refuses what it cannot go on from: a state it cannot read, one of another model, another tokenizer than the one
the run trained with, or a run already past --steps.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from kestrel.config import TrainConfig
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.weights import save_checkpoint
from kestrel.tokenizer import checkpoint_tokenizer_dir
from kestrel.train.bpe import build_tokenizer
from kestrel.train.data import PackedBatches
from kestrel.train.loss_plot import plot_loss
from kestrel.utils.errors import CheckpointError, ConfigError, TrainingDiverged

STATE_FILE = "trainer_state.pt"


def recover_checkpoint(ckpt: Path) -> None:
    """A run killed between `_swap_in`'s renames: its last checkpoint back in its place."""
    old = ckpt.with_name(ckpt.name + ".old")
    if not ckpt.exists() and old.is_dir():
        os.replace(old, ckpt)


def run_tokenizer_dir(cfg: TrainConfig, out: Path, vocab_size: int) -> Path:
    """--tokenizer; else a checkpoint's own (its token ids are what its weights know); else a BPE trained
    into <out>/tokenizer for a preset's random weights."""
    if cfg.tokenizer:
        return Path(cfg.tokenizer)
    own = checkpoint_tokenizer_dir(cfg.model)
    if own is not None:
        return own
    path = out / "tokenizer"
    if not (path / "tokenizer.json").exists():
        # built beside, then renamed: a run stopped while it wrote left a tokenizer.json without its
        # tokenizer_config.json (no pad token), which the next run took for a whole tokenizer
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        build_tokenizer(str(partial), vocab_size=vocab_size, seed=cfg.seed)
        _swap_in(partial, path)
    return path


def save_run(
    out: Path,
    cfg: TrainConfig,
    model: KimiForCausalLM,
    opt: torch.optim.Optimizer,
    tokenizer_dir: Path,
    *,
    step: int,
    data_state: dict,
    history: list[dict],
    train_seconds: float,
) -> Path:
    """HF checkpoint (bf16, what the engine loads) + tokenizer + trainer state (fp32 master, optimizer)."""
    ckpt = out / "checkpoint"
    finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()  # one sync
    if not finite:  # never over a good checkpoint
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        raise TrainingDiverged(
            f"step {step}: {len(bad)} weight tensors hold NaN or infinite values ({bad[0]}, ...); "
            f"not saved, {what_is_kept(out)}"
        )
    # written whole beside the last one, then swapped in: a run killed (or a disk filled) mid-save keeps its
    # last checkpoint whole (written in place, it was left without some of its shards, or with a truncated one)
    partial = ckpt.with_name(ckpt.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # shards of at most 15 MiB: small enough to move between machines file by file
    save_checkpoint(model, partial, dtype=torch.bfloat16, max_shard_bytes=15 * 2**20)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        src = tokenizer_dir / name  # (the tokenizer may be the last checkpoint's own)
        if src.exists():
            (partial / name).write_text(src.read_text())
    _swap_in(partial, ckpt)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "data": data_state,
        "history": history,
        "train_seconds": train_seconds,
        "config": asdict(cfg),
    }
    # written beside, then renamed over: a run killed mid-save keeps its last whole state
    partial = out / (STATE_FILE + ".partial")
    torch.save(state, partial)
    os.replace(partial, out / STATE_FILE)
    (out / "history.json").write_text(json.dumps(history))
    plot_loss(history, out / "loss.png")
    return ckpt


def what_is_kept(out: Path) -> str:
    """What a run stopped by NaN leaves: its last checkpoint, or none (it diverged before its first save)."""
    ckpt = out / "checkpoint"
    return f"its last checkpoint in {ckpt} is kept" if ckpt.is_dir() else "it has saved no checkpoint"


def resume_run(
    out: Path,
    cfg: TrainConfig,
    model: KimiForCausalLM,
    opt: torch.optim.Optimizer,
    data: PackedBatches,
    tokenizer_dir: Path,
    device: torch.device,
) -> tuple[int, list[dict], float]:
    """The run saved in `out`, if any, loaded into the model, the optimizer and the data stream; returns its
    (step, history, training seconds), or (0, [], 0.0) for a new run."""
    path = out / STATE_FILE
    if not path.exists():
        return 0, [], 0.0
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # noqa: BLE001 - truncated, not a torch file, unpicklable: one line
        raise CheckpointError(
            f"{path}: the training state cannot be read ({type(e).__name__}: {_first_line(e)[:160]}); "
            "remove it to start over, or train into a new --out"
        ) from None
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (
        RuntimeError,
        ValueError,
        KeyError,
    ) as e:  # another model, or another Kestrel's parameter layout
        raise CheckpointError(
            f"{path}: this training state does not fit the model ({_first_line(e)[:200]}); resume it with the same "
            "model and Kestrel version, or train into a new --out"
        ) from None
    _check_same_tokenizer(out, tokenizer_dir)
    step = state["step"]
    if step > cfg.steps:  # (it ran on quietly: nothing trained, the summary rewritten)
        raise ConfigError(
            f"{out} is at step {step} already, past --steps {cfg.steps}: pass a --steps "
            f"above {step} to train on from it, or train into a new --out"
        )
    data.load_state_dict(state["data"])
    resumed = step, state["history"], state.get("train_seconds", 0.0)
    if step >= cfg.steps:  # done: `train()` would train nothing
        print(
            f"[kestrel] {out} is already complete at step {step}: nothing to train "
            "(a larger --steps trains on from it)",
            file=sys.stderr,
        )
        return resumed
    saved, now = state.get("config", {}), asdict(cfg)
    changed = sorted(k for k in now if k in saved and saved[k] != now[k] and k != "steps")
    print(f"[kestrel] resuming {out} at step {step} of {cfg.steps}", file=sys.stderr)
    if changed:
        print(
            "[kestrel] changed since the saved run: "
            + ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in changed),
            file=sys.stderr,
        )
    return resumed


def _check_same_tokenizer(out: Path, tokenizer_dir: Path) -> None:
    """A resumed run goes on with the tokenizer it trained with (its checkpoint's copy): another one's ids mean
    other text to the weights, which went on training on them with only a line saying the option changed (a
    run started with --tokenizer and resumed without it trained a new BPE into <out>/tokenizer)."""
    trained = out / "checkpoint" / "tokenizer.json"
    given = tokenizer_dir / "tokenizer.json"
    if not trained.is_file() or trained == given:
        return
    if not given.is_file() or json.loads(trained.read_text()) != json.loads(given.read_text()):
        raise CheckpointError(
            f"{out} trained with the tokenizer in {trained.parent}, not the one in {tokenizer_dir}: "
            f"resume it with --tokenizer {trained.parent}, or train into a new --out"
        )


def _swap_in(new: Path, ckpt: Path) -> None:
    """Put the folder `new` in the place of `ckpt` (a checkpoint, or the run's tokenizer) by renames. A kill
    between the two leaves the last checkpoint whole as <ckpt>.old, which `recover_checkpoint` puts back."""
    old = ckpt.with_name(ckpt.name + ".old")
    # (without `ckpt`, a kill between the renames left the last one at `old`: keep it until `new` is in)
    if ckpt.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(ckpt, old)
    os.replace(new, ckpt)
    shutil.rmtree(old, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    """An exception's message, its first line (its type's name where it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
