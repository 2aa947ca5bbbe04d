"""`TrainConfig`: the settings of `kestrel train`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kestrel.utils.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    """`kestrel train`: pretraining / SFT of a preset (or a checkpoint) on the procedural task mixture."""

    out_dir: str
    model: str = "demo"  # preset name (random init) or checkpoint folder to continue from
    tokenizer: str | None = (
        None  # folder with tokenizer.json; default: <out_dir>/tokenizer, trained if missing
    )
    seed: int = 0
    steps: int = 1000
    batch_rows: int = 16  # B: rows per batch
    grad_accum: int = 1  # batches per optimizer step (each a forward and backward; their gradients add up)
    row_len: int = 4096  # R: tokens per row (documents never cross rows)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dsa_dense_steps: int = 200  # dense warm-up: attention over all visible tokens, the indexer learns by KL
    indexer_kl_weight: float = 1.0
    bias_update_rate: float = 1e-3  # aux-loss-free MoE balancing: bias += rate * sign(mean load - load)
    checkpoint_every: int = 500
    log_every: int = 10
    time_budget_s: float | None = None  # stop (and checkpoint) after this much training time
    device: str = "auto"
    data_workers: int = 0
    retrieval_lengths: tuple[int, ...] = (
        2048,
    )  # context lengths of the retrieval family's training documents
    # the retrieval family's weight in the draw, against 1.0 for each arithmetic family. Measured at 8 rows of
    # 8704 with 2K/8K documents: 0.1 gives 8.3 retrieval documents a step (67% of the tokens, 1.8% of the loss
    # tokens) among 271; 0.2 gives 8.7 among 196 (the rows are full of long documents already)
    retrieval_weight: float = 0.1
    # share of retrieval training problems in which a distractor's code shares its first 1-4 digits with the
    # asked one (train.retrieval.Retrieval); held-out sets keep none
    retrieval_shared_prefix: float = 0.0
    # (lo, hi): distractor facts per retrieval training problem, drawn uniformly; None keeps the level's (1-3);
    # hi <= 32, train.retrieval.Retrieval.MAX_DISTRACTORS
    retrieval_distractors: tuple[int, int] | None = None
    # a shared-prefix problem (retrieval_shared_prefix) gives every distractor a shared prefix, not one
    retrieval_shared_all: bool = False
    # the weight of the retrieval documents' loss tokens in the weighted mean loss, against 1.0 for the other
    # families: more gradient toward the lookup without drawing (and computing) more retrieval documents
    retrieval_loss_weight: float = 1.0

    def __post_init__(self):
        d = self.retrieval_distractors
        checks = [
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (self.batch_rows >= 1, f"batch_rows must be >= 1, got {self.batch_rows}"),
            (self.row_len >= 16, f"row_len must be >= 16, got {self.row_len}"),
            (self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}"),
            (0 < self.lr < math.inf, f"lr must be > 0 and finite, got {self.lr}"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.dsa_dense_steps >= 0, f"dsa_dense_steps must be >= 0, got {self.dsa_dense_steps}"),
            (self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (self.checkpoint_every >= 1, f"checkpoint_every must be >= 1, got {self.checkpoint_every}"),
            (self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}"),
            (
                self.time_budget_s is None or 0 < self.time_budget_s < math.inf,
                f"time_budget_s must be > 0 and finite (or None), got {self.time_budget_s}",
            ),
            (
                all(n < self.row_len for n in self.retrieval_lengths),
                f"retrieval_lengths must be shorter than row_len {self.row_len}, got {list(self.retrieval_lengths)}",
            ),
            (self.retrieval_weight >= 0, f"retrieval_weight must be >= 0, got {self.retrieval_weight}"),
            (
                0 < self.retrieval_loss_weight < math.inf,
                f"retrieval_loss_weight must be > 0 and finite, got {self.retrieval_loss_weight}",
            ),
            (
                0 <= self.retrieval_shared_prefix <= 1,
                f"retrieval_shared_prefix must be in [0, 1], got {self.retrieval_shared_prefix}",
            ),
            (
                d is None or (len(d) == 2 and 1 <= d[0] <= d[1] <= 32),
                f"retrieval_distractors must be (lo, hi) with 1 <= lo <= hi <= 32, got {d}",
            ),
        ]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ConfigError("; ".join(bad))
