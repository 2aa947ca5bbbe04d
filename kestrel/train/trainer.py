"""`kestrel train`: pretraining / SFT of the Kimi hybrid model on the procedural task mixture.

The loop reads top to bottom: batch -> forward (bf16 autocast over fp32 master weights) -> loss (masked
next-token cross-entropy + the DSA indexer's KL) -> backward -> clip -> AdamW step -> cosine LR -> MoE bias
update -> log -> checkpoint. DSA is trained the DeepSeek-V3.2 way: a dense warm-up in which attention sees every
visible token and the indexer learns to match it by KL, then sparse training over the indexer's top-k.

A step may take several batches (`grad_accum`): each is a forward and backward of its own, their gradients add up
to those of one batch of all their rows (the loss is the weighted mean over all their loss tokens), and one
optimizer step follows, so AdamW, the clipping and the bias update are paid once for all of them.

Deliberately left out: data parallelism (one device), mixed-length curriculum beyond the retrieval lengths of
TrainConfig, and activation checkpointing (the demo model is small).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kestrel.config import MOE, TrainConfig
from kestrel.layers.context import ForwardContext, forward_context
from kestrel.models.kimi import KimiForCausalLM
from kestrel.models.loader import build_model
from kestrel.ops.loss import weighted_token_losses
from kestrel.tokenizer import check_tokenizer_fits, load_tokenizer
from kestrel.train.checkpoint import recover_checkpoint, resume_run, run_tokenizer_dir, save_run, what_is_kept
from kestrel.train.data import DEFAULT_WEIGHTS, MixtureConfig, PackedBatches, Prefetch
from kestrel.train.flops import flops_per_token
from kestrel.train.objective import family_loss_sums, loss_weight_total
from kestrel.train.optim import clipped_step
from kestrel.utils.device import resolve_device, to_host_async
from kestrel.utils.errors import TrainingDiverged


def lr_at(step: int, cfg: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step, or at the end of the time
    budget when that comes first (elapsed_s: training time so far), so a run cut by its budget still anneals."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    if cfg.time_budget_s:
        progress = max(progress, elapsed_s / cfg.time_budget_s)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def mixture_config(cfg: TrainConfig) -> MixtureConfig:
    """The task mixture `kestrel train` draws its batches from, as its retrieval options set it."""
    return MixtureConfig(
        weights={**DEFAULT_WEIGHTS, "retrieval": cfg.retrieval_weight},
        retrieval_context_tokens=tuple(cfg.retrieval_lengths),
        retrieval_shared_prefix=cfg.retrieval_shared_prefix,
        retrieval_distractors=cfg.retrieval_distractors,
        retrieval_shared_all=cfg.retrieval_shared_all,
        loss_weights={"retrieval": cfg.retrieval_loss_weight},
    )


class StepFigures:
    """A queued training step's figures, in order: its (weighted) mean LM loss, the DSA indexer's KL averaged
    over the MLA layers, the worst max / mean expert load over the MoE layers, then each task family's plain
    mean LM loss (NaN for a family without loss tokens in the step's batches). On CUDA they are copied to pinned host
    memory behind the step's kernels and an event marks the copy, so `read()` waits for this step only (a
    `float()` of a device tensor waits for everything queued after the step too)."""

    def __init__(self, values: torch.Tensor):
        self._values, self._event = to_host_async(values)

    def read(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._values.tolist()


@torch.no_grad()
def update_expert_biases(
    model: KimiForCausalLM, routing: dict[int, torch.Tensor], rate: float
) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of under-loaded experts, lower the
    over-loaded ones, by `rate` each step. Returns the worst max-load / mean-load ratio over the layers, a
    0-dim tensor on the model's device (1 without MoE layers; read it when the step is done: no sync here)."""
    worst = None
    for layer_id, ids in routing.items():
        gate = model.model.layers[layer_id].mlp.gate
        E = gate.e_score_correction_bias.numel()
        load = torch.zeros(E, device=ids.device).index_add_(
            0, ids.flatten(), torch.ones(ids.numel(), device=ids.device)
        )
        gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
        ratio = load.max() / load.mean().clamp(min=1e-9)
        worst = ratio if worst is None else torch.maximum(worst, ratio)
    return torch.ones((), device=model.lm_head.weight.device) if worst is None else worst.clamp(min=1.0)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        recover_checkpoint(self.out / "checkpoint")
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.model = build_model(
            cfg.model,
            dtype=torch.float32,
            device=self.device,
            seed=cfg.seed,
            init_on_device=self.device.type == "cuda",
        )
        # trained to the model's vocabulary size when missing
        self.tokenizer_dir = run_tokenizer_dir(cfg, self.out, self.model.config.vocab_size)
        self.tokenizer = load_tokenizer(str(self.tokenizer_dir))
        check_tokenizer_fits(self.tokenizer, self.model.config.vocab_size)
        decay = [p for n, p in self.model.named_parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for n, p in self.model.named_parameters() if p.requires_grad and p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            fused=self.device.type == "cuda",
        )
        self.data = PackedBatches(
            str(self.tokenizer_dir) if cfg.data_workers else self.tokenizer,
            cfg.batch_rows,
            cfg.row_len,
            mixture_config(cfg),
            seed=cfg.seed,
            num_workers=cfg.data_workers,
        )
        self._data_state = None  # while training: the stream's state after the last batch trained on
        self.flops_per_token = flops_per_token(self.model, cfg.row_len)
        # where a run saved in `out` stopped, or the start; train_seconds: timed training so far (the first step
        # of each run left out), over resumes
        self.step, self.history, self.train_seconds = resume_run(
            self.out, cfg, self.model, self.opt, self.data, self.tokenizer_dir, self.device
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, model = self.cfg, self.model
        model.train()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        # The first step compiles and autotunes the kernels (minutes on a fresh GPU machine): the clock of the
        # time budget, the LR schedule and tokens/s starts after it. The clock carries over a resume.
        base = self.train_seconds
        run_start, start, tokens_done, timed_tokens, first_step_s = time.perf_counter(), None, 0, 0, None
        data_wait_s = 0.0  # timed seconds the loop waited for a batch (packing and rendering run ahead of it)
        # Batches are packed (and pinned) a few ahead in a thread while the GPU runs a step; the stream ahead of
        # the step is wound back to the step's when the loop ends, and a checkpoint saves the step's state.
        self._data_state = self.data.state_dict()  # where the stream stands when no step has run
        prefetch = Prefetch(self.data, depth=2 * cfg.grad_accum, pin=self.device.type == "cuda")  # 2 steps
        # Each step is queued before the step before it is read back (its loss, KL, expert load and family
        # losses), so that on a GPU the host prepares and launches step n while step n - 1 runs. `unread`: the
        # steps queued and not read yet, as (record, figures); all are read before every checkpoint.
        unread: list[tuple[dict, StepFigures]] = []
        first_tokens = 0  # the first step's tokens, which the clock leaves out

        def clock() -> float:  # timed seconds so far (the first step's end starts the clock)
            return self.train_seconds if start is None else base + time.perf_counter() - start

        def read(keep: int = 0) -> None:  # all but the `keep` newest unread steps, oldest first
            while len(unread) > keep:
                self._read_step(*unread.pop(0), clock)

        try:
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                batches, states = zip(*(next(prefetch) for _ in range(cfg.grad_accum)))
                waited = time.perf_counter() - t0
                step_tokens = sum(b.input_ids.numel() for b in batches)
                lr = lr_at(self.step, cfg, self.train_seconds)
                figures = self.launch_step(list(batches), lr)
                # the model holds these batches' update once the stream gets to them: the step counts from here
                self._data_state = states[-1]
                tokens_done += step_tokens
                unread.append(
                    ({"step": self.step, "lr": lr, "tokens": tokens_done, "data_wait_s": waited}, figures)
                )
                self.step += 1
                bar.update(1)
                # the first step (compiling, autotuning) is read at once: its end starts the clock
                if start is None:
                    read()
                    start, first_tokens = time.perf_counter(), tokens_done
                    first_step_s = start - run_start
                else:
                    timed_tokens += step_tokens
                    data_wait_s += waited
                    read(keep=1)  # the step before this one: waits for it, not for this one
                    self.train_seconds = clock()
                out_of_time = cfg.time_budget_s is not None and self.train_seconds > cfg.time_budget_s
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps or out_of_time:
                    read()
                    self.train_seconds = clock()
                    self.save()
                if self.history and (self.step % cfg.log_every == 0 or self.step == cfg.steps):
                    last = self.history[-1]  # the rate of the steps read, not of those only queued
                    tps = (last["tokens"] - first_tokens) / max(last["seconds"] - base, 1e-9)
                    bar.set_postfix(
                        loss=f"{last['loss']:.3f}",
                        kl=f"{last['indexer_kl']:.3f}",
                        tok_s=f"{tps:,.0f}",
                        mfu=f"{self.mfu(tps):.1%}" if self.device.type == "cuda" else "-",
                    )
                if out_of_time:
                    break
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through `kestrel train`: keep the steps done so far
            if tokens_done:
                read()
                self.train_seconds = clock()
                print(f"\n[kestrel] interrupted at step {self.step}: saving a checkpoint", file=sys.stderr)
                self.save()
            raise
        finally:
            queued = len(unread)
            try:  # an interrupted loop still records the steps it queued (the model has their updates)
                read()
            except TrainingDiverged:  # a later step's NaN, recorded: the run reports the first one's
                pass
            except Exception as e:  # (a failed device cannot give them back)
                print(f"[kestrel] {queued} queued steps could not be read back: {e}", file=sys.stderr)
            if prefetch.close():
                self.data.load_state_dict(self._data_state)
                self._data_state = None  # the stream is the step's again: save() reads it from there
            else:  # the checkpoints hold the right state; this object's stream is left where the thread stopped
                print("[kestrel] the data thread did not stop; the in-memory data stream is not wound back")
        bar.close()
        summary = self.summary(self.train_seconds - base, timed_tokens)  # after this run's first step
        return {
            **summary,
            "data_wait_s": data_wait_s,
            "tokens_this_run": tokens_done,
            "first_step_s": first_step_s,
            "train_seconds_total": self.train_seconds,
        }

    def _read_step(self, record: dict, figures: StepFigures, clock) -> None:
        """Read a queued step's figures back (waiting for that step) into its history record."""
        lm, kl, imbalance, *family = figures.read()
        by_family = {name: v for name, v in zip(self.data.family_names, family) if not math.isnan(v)}
        record.update(
            loss=lm, indexer_kl=kl, max_expert_load=imbalance, loss_by_family=by_family, seconds=clock()
        )
        self.history.append(record)
        if not math.isfinite(lm):
            raise TrainingDiverged(
                f"step {record['step']}: the loss is {lm} (the steps before it: "
                f"{[round(r['loss'], 4) for r in self.history[-4:-1]]}); the run stops here and "
                f"{what_is_kept(self.out)}. A lower --lr (this run's peak: {self.cfg.lr:g}) or more warmup steps "
                "may help"
            )

    def train_step(self, batch, lr: float | None = None) -> tuple[float, float, float]:
        """One optimizer step on `batch` (or a list of batches, their gradients summed): (LM loss, indexer KL,
        worst expert load ratio), read back when the step is done."""
        lm, kl, imbalance = self.launch_step(batch, lr).read()[:3]
        return lm, kl, imbalance

    def launch_step(self, batch, lr: float | None = None) -> StepFigures:
        """`train_step` that does not wait for the step: on a GPU the host can queue the next step while this one
        runs (the loop reads each step's figures after queuing the next). A list of batches is one step over
        all their rows, one forward and backward a batch: the LM loss is the weighted mean over all of them, the
        KL the mean of theirs, the MoE bias update and the figures over all their tokens."""
        cfg, model, dev = self.cfg, self.model, self.device
        batches = list(batch) if isinstance(batch, (list, tuple)) else [batch]
        if not batches:
            raise ValueError("launch_step: a step needs at least one batch")
        self.opt.zero_grad(set_to_none=True)  # nothing left over from a step an exception cut short
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg) if lr is None else lr
        weights = [b.loss_weight.to(dev, non_blocking=True).flatten() for b in batches]
        total = loss_weight_total(weights)
        parts = [self._forward_backward(b, w, total, len(batches)) for b, w in zip(batches, weights)]
        lm, kl, sums, counts, moe = zip(*parts)  # each over the step's batches
        one = len(parts) == 1  # the loop's usual step: its batch's figures as they are, no kernel to add them
        lm, kl, sums, counts = (x[0] if one else torch.stack(x).sum(0) for x in (lm, kl, sums, counts))
        routing = {layer: moe[0][layer] if one else torch.cat([m[layer] for m in moe]) for layer in moe[0]}
        clipped_step(self.opt, cfg.grad_clip)
        self.opt.zero_grad(set_to_none=True)
        imbalance = update_expert_biases(model, routing, cfg.bias_update_rate)
        head = torch.stack([lm, kl, imbalance.float()])
        return StepFigures(torch.cat([head, sums / counts]))  # 0 / 0 = NaN for a family without loss tokens

    def _forward_backward(self, batch, weight: torch.Tensor, total: torch.Tensor, parts: int):
        """One batch of a step: forward, its share of the step's loss (its weighted loss sum over the step's
        total weight `total`, plus the KL over the step's `parts` batches), backward. Returns that share's LM
        loss and KL (detached), the family loss sums and counts, and the MoE layers' routing ids [T, A]."""
        cfg, model, dev = self.cfg, self.model, self.device
        ids = batch.input_ids.to(dev, non_blocking=True).flatten()  # [B*R] (pinned by the loop's Prefetch)
        seg = batch.cu_seqlens.tolist()
        ctx = ForwardContext.build([b - a for a, b in zip(seg, seg[1:])], device=dev)
        ctx.row_len = batch.input_ids.shape[1]
        ctx.routing_capture = {}
        kl_terms: list = []
        ctx.extras.update(dsa_dense=self.step < cfg.dsa_dense_steps, indexer_kl=kl_terms)
        targets = batch.target_ids.to(dev, non_blocking=True).flatten()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"), forward_context(ctx):
            hidden = model.model(ids)  # [B*R, D]
            # the LM head and the loss together (losses [B*R] fp32): chunked over tokens where the logits would be
            # large, then with the gradients computed in the forward (the loss weights are known before it)
            loss_sum, losses = weighted_token_losses(hidden, model.lm_head.weight, targets, weight)
        lm = loss_sum / total  # masked_loss, over the step's batches
        family_ids = batch.family_ids.to(dev, non_blocking=True).flatten()
        sums, counts = family_loss_sums(losses, weight > 0, family_ids, len(self.data.family_names))
        kl = sum(kl_terms) / (len(kl_terms) * parts) if kl_terms else torch.zeros((), device=dev)
        (lm + cfg.indexer_kl_weight * kl).backward()
        moe = {k: v for k, v in ctx.routing_capture.items() if model.config.mlp_types[k] == MOE}
        return lm.detach(), kl.detach().float(), sums, counts, moe

    def mfu(self, tokens_per_s: float, peak_tflops: float = 989.0) -> float:
        """Model FLOP utilization against the H200's dense bf16 peak (the run's measured matmul rate is
        reported beside it by the benchmark script)."""
        return tokens_per_s * self.flops_per_token / (peak_tflops * 1e12)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Save the run as it stands into its --out (`save_run`): the checkpoint, the trainer state, the history
        and its loss plot. Returns the checkpoint's folder."""
        return save_run(
            self.out,
            self.cfg,
            self.model,
            self.opt,
            self.tokenizer_dir,
            step=self.step,
            data_state=self._data_state if self._data_state is not None else self.data.state_dict(),
            history=self.history,
            train_seconds=self.train_seconds,
        )

    @property
    def done(self) -> bool:
        """The run has trained all its steps (a resume of a finished run: `train()` would train nothing)."""
        return self.step >= self.cfg.steps

    def summary(self, seconds: float, tokens: int) -> dict:
        """The run's figures. Its first step (compiling, autotuning) is not timed: with no step after it, the rate
        is None, not 0."""
        tps = tokens / max(seconds, 1e-9) if tokens else None
        last = self.history[-20:] if self.history else []
        return {
            "steps": self.step,
            "seconds": seconds,  # after the first step
            "tokens": tokens,
            "tokens_per_s": tps,
            "flops_per_token": self.flops_per_token,
            "mfu_vs_989_tflops": self.mfu(tps) if tps is not None else None,
            "final_loss": sum(r["loss"] for r in last) / max(len(last), 1),
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }
