"""Tiles, warps and stages of the two DSA prefill kernels that grow with the square of the chunk, timed at `mini`'s
sizes on one sequence of T tokens (T = 4096 and 32768, the packed-prefill cases of issue 4):

  indexer   `indexer_scores_prefill_triton`: [T, L] fp32 scores of 16 heads of 128 over the paged index keys,
            every row causal; each (block_m, block_s, warps, stages), and the default with fill_past=False
  expanded  `sparse_mla_prefill_expanded` with a top-2048 selection of each query: each (block_m, block_n,
            warps, stages), the history's expansion and the selection bitmap included
  topk      `topk_triton` of 2048 over the same triangle of scores (rows before position 2048 are short)

Every variant's output is checked against the first (the default) before it is timed: the indexer's within
1e-4 relative, the attention's within bf16's rounding. Median of --reps CUDA-event timings, L2-warm.
A kernel alone here can time otherwise than inside the engine's prefill step (session 13: the expanded kernel
in 64 x 64 tiles was as fast as 128 x 128 here and 18% slower in the step), so a new default is confirmed with
`scripts/gpu_suite.py --sections prefill_bench` before it is kept.

    python3 scripts/prefill_kernel_sweep.py --out $OUT                    # H200: $OUT/prefill_kernel_sweep.json
    python3 scripts/prefill_kernel_sweep.py --smoke --out /tmp/sweep      # tiny sizes (CPU: TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton.runtime.errors import OutOfResources  # noqa: E402

from kestrel.ops.dsa.triton_scores import indexer_scores_prefill_triton  # noqa: E402
from kestrel.ops.dsa.triton_topk import topk_triton  # noqa: E402
from kestrel.ops.mla.triton_prefill_expanded import sparse_mla_prefill_expanded  # noqa: E402

# (block_m, block_s or block_n, num_warps, num_stages); the first of each list is the default
INDEXER = [(64, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
           (64, 256, 8, 3), (32, 128, 4, 3)]  # fmt: skip
# 3 stages at 128 x 128 or 128 x 64 in 8 warps need more shared memory than the H200's 227 KiB (recorded, skipped)
EXPANDED = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 64, 4, 2),
            (128, 128, 8, 3)]  # fmt: skip
SMOKE_TILES = [(16, 32, 4, 2), (32, 32, 4, 2)]  # the interpreter has no shared-memory limit


def timed(fn, reps: int, device: str) -> float:
    """Median ms of fn() over reps runs after one warm-up (CUDA events on the GPU, wall time on CPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def indexer_case(T: int, heads: int, dim: int, page: int, tiles: list, reps: int, device: str) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(T)
    q = torch.randn(T, heads, dim, generator=g, device=device).to(torch.bfloat16)  # [T, HI, DI]
    w = torch.randn(T, heads, generator=g, device=device).to(torch.bfloat16)  # [T, HI]
    pages = torch.randperm(T // page, generator=g, device=device) + 3  # [P] scattered pages
    pool = torch.randn((T // page + 3) * page, dim, generator=g, device=device).to(torch.bfloat16)
    lens = torch.arange(1, T + 1, device=device)  # a whole prompt: row t sees t + 1 keys
    valid = torch.arange(T, device=device)[None, :] < lens[:, None]  # [T, L]
    rows, ref = [], None
    for fill_past in (True, False):
        for bm, bs, warps, stages in tiles if fill_past else tiles[:1]:
            out = torch.empty(T, T, dtype=torch.float32, device=device)
            run = functools.partial(
                indexer_scores_prefill_triton, q, pool, pages, lens, w, 0.1, page_size=page, out=out,
                block_m=bm, block_s=bs, num_warps=warps, num_stages=stages, fill_past=fill_past,
            )  # fmt: skip
            try:
                got = run()[valid]
            except OutOfResources as e:
                rows.append(dict(T=T, block_m=bm, block_s=bs, warps=warps, stages=stages, error=str(e)[:200]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            ref = got.clone() if ref is None else ref
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, f"indexer {bm, bs, warps, stages}: relative error {err}"
            ms = timed(run, reps, device)
            rows.append(dict(T=T, block_m=bm, block_s=bs, warps=warps, stages=stages, fill_past=fill_past, ms=ms,
                             rel_err=err, TFLOPs=2 * T * (T + 1) / 2 * heads * dim / ms / 1e9))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del out, run
    return rows


def expanded_case(T: int, k: int, heads: int, tiles: list, reps: int, device: str, dims=(128, 64, 128, 512)):
    Dn, P, Dv, R = dims
    g = torch.Generator(device=device).manual_seed(T + 1)
    bf = torch.bfloat16 if device == "cuda" else torch.float32
    kv = torch.randn(T, R + P, generator=g, device=device).to(bf)  # [L, R + P]
    w_uk = (torch.randn(heads, Dn, R, generator=g, device=device) * R**-0.5).to(bf)
    w_uv = (torch.randn(heads, Dv, R, generator=g, device=device) * R**-0.5).to(bf)
    q_nope = torch.randn(T, heads, Dn, generator=g, device=device).to(bf)
    q_pe = torch.randn(T, heads, P, generator=g, device=device).to(bf)
    scores = torch.randn(T, T, generator=g, device=device)  # a stand-in for the indexer's: random sets
    indices = topk_triton(scores, torch.arange(1, T + 1, device=device), k)  # [T, k]
    del scores
    rows, ref = [], None
    for bm, bn, warps, stages in tiles:
        run = functools.partial(
            sparse_mla_prefill_expanded, q_nope, q_pe, kv, w_uk, w_uv, 0.1, indices, block_m=bm, block_n=bn,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        try:
            got = run().float()
        except OutOfResources as e:  # a tiling the GPU cannot hold: recorded, not timed
            rows.append(
                dict(T=T, k=k, block_m=bm, block_n=bn, warps=warps, stages=stages, error=str(e)[:200])
            )
            print(json.dumps(rows[-1]), flush=True)
            continue
        ref = got if ref is None else ref
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, f"expanded {bm, bn, warps, stages}: relative error {err}"
        ms = timed(run, reps, device)
        pairs = T * (T + 1) / 2 * heads  # (query, causal key) pairs of every head: the kernel walks them all
        rows.append(dict(T=T, k=k, block_m=bm, block_n=bn, warps=warps, stages=stages, ms=ms, rel_err=err,
                         causal_TFLOPs=2 * pairs * (Dn + P + Dv) / ms / 1e9))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def topk_case(T: int, k: int, reps: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(T + 2)
    scores = torch.randn(T, T, generator=g, device=device)
    lens = torch.arange(1, T + 1, device=device)
    ms = timed(lambda: topk_triton(scores, lens, k), reps, device)
    row = dict(T=T, k=k, ms=ms, causal_GBps=T * (T + 1) / 2 * 4 / ms / 1e6)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: the interpreter)")
    ap.add_argument("--sizes", default="4096,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="indexer,expanded,topk")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    only = args.only.split(",")
    if args.smoke:
        sizes, k, heads, page, reps = [48], 20, 2, 8, 1
        indexer_tiles = expanded_tiles = SMOKE_TILES
        dims = (16, 8, 16, 32)
    else:
        sizes, k, heads, page, reps = [int(s) for s in args.sizes.split(",")], 2048, 16, 64, args.reps
        indexer_tiles, expanded_tiles, dims = INDEXER, EXPANDED, (128, 64, 128, 512)
    record = {
        "what": "DSA prefill kernels at mini's sizes: tiles, warps, stages (scripts/prefill_kernel_sweep.py)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join(["python3", *sys.argv]),
        "indexer": [],
        "expanded": [],
        "topk": [],
    }
    for T in sizes:
        if "indexer" in only:
            record["indexer"] += indexer_case(T, heads, dims[0], page, indexer_tiles, reps, device)
        if "expanded" in only:
            record["expanded"] += expanded_case(T, k, heads, expanded_tiles, reps, device, dims)
        if "topk" in only:
            record["topk"].append(topk_case(T, k, reps, device))
        if device == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_kernel_sweep.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
