"""The picture of a training run's loss: <out>/loss.png, redrawn at every checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch


def plot_loss(history: list[dict], path: Path, window: int = 50) -> None:
    """A PNG of the LM loss and the indexer KL against the step, and beside it each task family's LM loss
    (the mean over the last `window` steps that had the family: a batch holds few documents of some)."""
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    families = sorted({name for r in history for name in r.get("loss_by_family", {})})
    fig, axes = plt.subplots(1, 2 if families else 1, figsize=(13 if families else 7, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in history], label="LM loss (answer tokens)")
    ax.plot(steps, [r["indexer_kl"] for r in history], label="DSA indexer KL", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    if families:
        ax = axes[0][1]
        for name in families:
            points = [
                (r["step"], r["loss_by_family"][name]) for r in history if name in r.get("loss_by_family", {})
            ]
            values = torch.tensor([v for _, v in points], dtype=torch.float64)
            running = values.cumsum(0)
            running[window:] = running[window:] - running[:-window].clone()
            mean = running / torch.arange(1, len(values) + 1).clamp(max=window)
            ax.plot([s for s, _ in points], mean.tolist(), label=name)
        ax.set_title(f"LM loss by task family (mean of {window} batches)")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
