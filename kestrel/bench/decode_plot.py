"""A picture of `kestrel bench decode`'s JSON: where each point's step goes.

One bar a point (batch, context, attention), as long as its `Engine.step()` time, cut into: the bytes the step
must move at the copy rate measured in the same run (that share of the bar is the point's MBU), the kernel
launches at the cost of one dependent launch measured in the run (where `--profile` measured it), and the rest.
A tick marks the bare CUDA-graph replay, and a red line the step time issue 4's target allows (batch 1 at 4K:
70% MBU; batch 256 at 4K: 60%). Each bar is drawn to its own step's length (100%), so that batch 1 and batch 256
read on one axis; its milliseconds are written beside it.

    kestrel bench plot-decode decode.json [--out decode.png]    (or .pdf, .svg: the suffix names the format)
`kestrel bench decode --out X.json` draws X.png beside it where matplotlib is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kestrel.utils.errors import KestrelError

# issue 4's decode targets: (batch, context) -> MBU, DSA attention
TARGETS = {(1, 4096): 0.70, (256, 4096): 0.60}


def bars(result: dict) -> list[dict]:
    """Each run of a `bench decode` result as the parts of its step, in ms: bytes at the copy rate, launches (None
    where not measured), the rest; the replay, the target step (None where no target applies) and a label."""
    if not isinstance(result, dict) or result.get("benchmark") != "decode" or not result.get("runs"):
        raise ValueError("not a `kestrel bench decode` result (no benchmark 'decode' with runs)")
    try:
        copy = result["ceilings"]["copy_TBps"] * 1e12  # bytes a second
        if not copy > 0:  # (each bar divides by it and by each step's time: a ZeroDivisionError, a traceback)
            raise ValueError(f"a `bench decode` result with a copy rate of {result['ceilings']['copy_TBps']}")
        return [_bar(run, copy) for run in result["runs"]]
    except KeyError as e:
        raise ValueError(f"a `bench decode` result without {e}") from None


def _bar(run: dict, copy: float) -> dict:
    """One run's parts (`bars`); `copy` in bytes a second."""
    step = run["step_ms"]
    if not step > 0:
        raise ValueError(f"a `bench decode` run with a step of {step} ms")
    bytes_ms = run["bytes"]["total"] / copy * 1e3
    floor = run.get("launch_floor")
    launches = floor["launches_ms"] if floor else None
    target = TARGETS.get((run["batch"], run["context"])) if run["attention"] == "DSA" else None
    label = f"batch {run['batch']}, {_tokens(run['context'])}, {run['attention']}"
    limit, width = run.get("max_model_len"), run.get("graph_width")
    if limit and limit > 2 * run["context"]:  # an engine of a longer limit than the point needs
        label += f", limit {_tokens(limit)}"
    if width and limit and width < limit:  # the step replayed a short graph
        label += f", graph {_tokens(width)}"
    if run.get("sampling", "greedy") != "greedy":
        label += f", {run['sampling']}"
    return {
        "label": label,
        "step_ms": step,
        "bytes_ms": bytes_ms,
        "launches_ms": launches,
        "rest_ms": max(0.0, step - bytes_ms - (launches or 0.0)),
        "replay_ms": run.get("graph_replay_ms"),
        "target_ms": bytes_ms / target if target else None,
        "target": target,
        "kernels": floor["kernels"] if floor else None,
    }


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n / 1024:.1f}K"


def image_format(path: Path) -> str:
    """The format `path`'s suffix names (png where it has none); ValueError for a suffix matplotlib writes no
    format for, which had been a PNG under that name."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    suffix = Path(path).suffix.removeprefix(".").lower()
    if not suffix:
        return "png"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"matplotlib writes no .{suffix} (give one of .{', .'.join(sorted(formats))})")
    return suffix


def plot_decode(result: dict, path: Path) -> Path:
    """Draw `bars(result)` into `path`, in the format its suffix names (`image_format`)."""
    fmt = image_format(path)  # before the drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = bars(result)
    height = 1.9 + 0.5 * len(rows)  # inches: title, the bars, the axis and a two-row legend under it
    fig, ax = plt.subplots(figsize=(10, height))
    parts = (
        ("bytes_ms", "tab:blue", "bytes at the copy rate (its share is the MBU)"),
        ("launches_ms", "tab:orange", "kernel launches x one dependent launch's cost"),
        ("rest_ms", "0.8", "the rest: kernels' own latency, bandwidth under the copy rate"),
    )
    for y, r in enumerate(rows):
        share = 100.0 / r["step_ms"]  # each bar is its own step: percent of it
        left = 0.0
        for key, color, _ in parts:
            if r[key] is not None:
                width = min(r[key] * share, 100.0 - left)
                ax.barh(y, width, left=left, color=color, height=0.7)
                left += width
        if r["replay_ms"]:
            ax.plot([r["replay_ms"] * share] * 2, [y - 0.35, y + 0.35], color="black", lw=1.5)
        if r["target_ms"]:
            ax.plot([r["target_ms"] * share] * 2, [y - 0.45, y + 0.45], color="red", lw=2.5)
        note = f"{r['step_ms']:.2f} ms, MBU {r['bytes_ms'] / r['step_ms']:.1%}"
        if r["target"]:
            note += f" (target {r['target']:.0%})"
        if r["kernels"]:
            note += f"\n{r['kernels']:.0f} kernels"
        ax.annotate(note, (101, y), fontsize=8, va="center")
    legend = [Patch(color=c, label=n) for key, c, n in parts if any(r[key] is not None for r in rows)]
    legend.append(Line2D([], [], color="black", lw=1.5, label="the CUDA graph's bare replay"))
    if any(r["target_ms"] for r in rows):
        legend.append(Line2D([], [], color="red", lw=2.5, label="the step time issue 4's target MBU allows"))
    fig.legend(handles=legend, loc="lower center", ncol=2, fontsize=8, frameon=False)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, 136)
    ax.set_xticks(range(0, 101, 20), [f"{x}%" for x in range(0, 101, 20)])
    ax.set_xlabel(
        "share of each point's decode step (Engine.step(): scheduling and sampling included)", fontsize=9
    )
    c = result["ceilings"]
    ax.set_title(
        f"kestrel bench decode: {result['model']} on {result['gpu']}, {result['date'][:10]}; "
        f"copy {c['copy_TBps']:.2f} TB/s in the same run",
        fontsize=10,
    )
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.75 / height, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format=fmt)  # the name as given (without a suffix matplotlib added .png)
    plt.close(fig)
    return path


def cmd_plot_decode(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise KestrelError(f"kestrel bench plot-decode needs {e.name} (pip install {e.name})") from None
    if args.out is not None:  # before the result is read
        try:
            if args.out.is_dir():
                raise ValueError("is a folder; give the picture's name")
            image_format(args.out)
        except ValueError as e:
            print(f"kestrel bench plot-decode: --out {args.out}: {e}", file=sys.stderr)
            return 2
    try:
        result = json.loads(Path(args.result).read_text())
        if isinstance(result, dict) and "decode" in result and "runs" not in result:
            result = result["decode"]  # a gpu_suite section, or a session record's call, holding the result
        path = plot_decode(result, args.out or Path(args.result).with_suffix(".png"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"kestrel bench plot-decode: {args.result}: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
