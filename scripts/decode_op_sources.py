"""Which lines of Python launch the small copy / index / elementwise kernels of a decode step: one eager step
of `mini` (CUDA graphs off) at a batch, under torch.profiler with Python stacks, the ATen ops that launch
those kernels grouped by their call site, with their GPU time. The graph-replay profile of `bench decode
--profile` names kernels only (`direct_copy_kernel_cuda` x24 a step, ...); this says where they come from.

    PYTHONPATH=$PWD python3 scripts/decode_op_sources.py --batch 256 --out $OUT/op_sources.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.bench.decode import fill_pools, place_in_decode  # noqa: E402
from kestrel.config.engine import EngineConfig  # noqa: E402
from kestrel.engine.engine import Engine  # noqa: E402
from kestrel.models.loader import build_model  # noqa: E402

OPS = ("aten::copy_", "aten::index", "aten::index_put_", "aten::add", "aten::add_", "aten::mul", "aten::cat")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--model", default="mini")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "op_sources.json"))
    args = parser.parse_args()
    from torch.profiler import ProfilerActivity, profile

    net = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0, init_on_device=True)
    cfg = EngineConfig(
        model=args.model,
        max_running_requests=args.batch,
        max_model_len=args.context + 64,
        enable_prefix_cache=False,
        disable_cuda_graph=True,
    )
    engine = Engine(cfg, model=net)
    fill_pools(engine)
    place_in_decode(engine, args.batch, args.context, 16)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # without it the events' stacks are empty
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        with_stack=True,
        record_shapes=True,
        experimental_config=verbose,
    ) as prof:
        engine.step()
        torch.cuda.synchronize()
    sites: dict = {}  # (op, shapes, call site) -> [calls, GPU us]
    for e in prof.events():
        if e.name not in OPS or e.device_time_total <= 0:
            continue
        frames = [f for f in e.stack if "kestrel" in f and "decode_op_sources" not in f][:3]
        key = (e.name, str(e.input_shapes)[:120], " <- ".join(frames))
        calls, us = sites.get(key, (0, 0.0))
        sites[key] = (calls + 1, us + e.device_time_total)
    rows = [
        {"op": op, "shapes": shapes, "site": site, "calls": calls, "gpu_us": us}
        for (op, shapes, site), (calls, us) in sorted(sites.items(), key=lambda kv: -kv[1][1])
    ]
    for r in rows[:25]:
        print(
            f"{r['op']:18s} x{r['calls']:3d} {r['gpu_us']:7.1f} us {r['shapes'][:70]:70s} {r['site']}",
            flush=True,
        )
    Path(args.out).write_text(
        json.dumps({"batch": args.batch, "context": args.context, "ops": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
