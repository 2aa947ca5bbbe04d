"""A picture of a traced CUDA chain: each block's stages on one time line, from the whole traces `l2` keeps
(chain_trace_<k>.pt in a call's tgz: kestrel.ops.linear.cuda_chain_trace.compact_trace, with the stage shapes).

    ./run python scripts/chain_trace_plot.py CALL.tgz|TRACE.pt [--stages 24:28] [--out DIR]

One PNG a trace (DIR/chain_trace_<k>.png; DIR defaults to the input's folder). A row a block, time across (us from
the first point drawn): grey while its consumers wait for the input (start to input in), blue while they sum the
pages (to pages summed), orange while they store (to stored); black and red ticks where the stage's first and last
page are in (their warp through its wait), a green one where the producer issued the stage's last page. Each
trace's by_class (chain_trace_summary) is printed. The stages drawn default to two layers in the middle of the
chain.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path

import torch

from kestrel.ops.linear.cuda_chain_trace import aligned_us, chain_trace_summary

SPANS = ((0, 1, "0.75", "input wait"), (1, 2, "tab:blue", "sums"), (2, 3, "tab:orange", "stores"))
TICKS = ((6, "k", "first page in"), (7, "tab:red", "last page in"), (5, "tab:green", "last page issued"))


def load(path: Path) -> dict[str, dict]:
    """The traces in `path` (a tgz's chain_trace_*.pt members, or one .pt): name -> {"trace", "shapes"}."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file")
    if path.suffix == ".pt":
        return {path.stem: torch.load(path, weights_only=True)}
    try:
        with tarfile.open(path) as tar:
            members = [m for m in tar.getmembers() if Path(m.name).name.startswith("chain_trace_")]
            found = {
                Path(m.name).stem: torch.load(io.BytesIO(tar.extractfile(m).read()), weights_only=True)
                for m in members
            }
    except tarfile.TarError as e:
        raise SystemExit(f"{path}: neither a .pt trace nor a readable tgz ({e})") from None
    if not found:
        raise SystemExit(f"{path}: no chain_trace_*.pt in it (a call of `l2` with traced chains keeps them)")
    return found


def stage_range(spec: str | None, stages: int, per_layer: int) -> range:
    """`a:b` (Python's slice, clipped to the chain), or two layers from the middle."""
    if spec is None:
        first = stages // 2 // per_layer * per_layer
        return range(first, min(stages, first + 2 * per_layer))
    try:
        a, b = (int(v) for v in spec.split(":"))
    except ValueError:
        raise SystemExit(f"--stages {spec!r}: want FIRST:END, e.g. 24:28") from None
    picked = range(stages)[a:b]
    if not picked:
        raise SystemExit(f"--stages {spec!r}: no stage of the chain's {stages}")
    return picked


def draw(name: str, trace: torch.Tensor, shapes: list, stages: range, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at, _ = aligned_us(trace)
    at = at[:, stages.start : stages.stop]
    t0 = at[~at.isnan()].min().item()
    at = at - t0
    blocks = at.shape[0]
    fig, ax = plt.subplots(figsize=(12, max(3.0, blocks * 0.045 + 1.5)))
    for a, b, color, label in SPANS:
        for s in range(at.shape[1]):
            left, right = at[:, s, a], at[:, s, b]
            ok = ~(left.isnan() | right.isnan())
            y = torch.arange(blocks)[ok]
            ax.barh(
                y, (right - left)[ok], left=left[ok], height=0.9, color=color, label=label if s == 0 else None
            )
    for k, color, label in TICKS:
        for s in range(at.shape[1]):
            x = at[:, s, k]
            ok = ~x.isnan()
            ax.scatter(x[ok], torch.arange(blocks)[ok], s=2, color=color, label=label if s == 0 else None)
    tops = [
        f"{stages.start + s}: {shapes[stages.start + s][0]}x{shapes[stages.start + s][1]}"
        for s in range(at.shape[1])
    ]
    ax.set_title(f"{name}: stages {', '.join(tops)}", fontsize=9)
    ax.set_xlabel("us")
    ax.set_ylabel("block")
    ax.set_ylim(-1, blocks)
    ax.legend(loc="upper right", fontsize=7, markerscale=4)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", type=Path, help="a call's tgz, or one chain_trace_<k>.pt")
    parser.add_argument("--stages", help="FIRST:END, the stages drawn (default: two layers in the middle)")
    parser.add_argument("--out", type=Path, help="the folder for the PNGs (default: the input's)")
    args = parser.parse_args(argv)
    out = args.out or args.input.parent
    out.mkdir(parents=True, exist_ok=True)
    for name, d in sorted(load(args.input).items()):
        trace, shapes = d["trace"], [tuple(s) for s in d["shapes"]]
        summary = chain_trace_summary(trace, shapes)
        for shape, c in summary.get("by_class", {}).items():
            spans = ", ".join(f"{k} {v:.2f}" for k, v in c.items() if k != "stages")
            print(f"{name} {shape} ({c['stages']} stages): {spans}")
        picked = stage_range(args.stages, trace.shape[1], max(1, len(set(shapes))))
        print(f"wrote {draw(name, trace, shapes, picked, out)}")


if __name__ == "__main__":
    sys.exit(main())
