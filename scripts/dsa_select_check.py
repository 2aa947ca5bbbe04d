"""Sparse training's DSA selection (`MLAttention._select_rows`) on the GPU at mini's sizes: 3 rows of 8704 tokens,
16 x 128 indexer heads, top-2048. Times the layer's path against session 30's (every picked query scored over its
whole causal row, the document's start masked through a gathered [M, R] copy of the mask, the selection built as
an [M, R + 1] scatter, ANDed and written back), stage by stage for the latter, and checks that both leave the
same mask. Writes $OUT/dsa_select_check.json.

    python3 scripts/dsa_select_check.py        (on the device, with PYTHONPATH at the repository root)
"""

import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from kestrel.layers.indexer import Indexer
from kestrel.layers.mla import MLAttention
from kestrel.ops.dsa import fast_topk, selection_mask
from kestrel.presets import preset_config

DOCS = {  # document lengths of each row: long retrieval documents beside short task ones
    "mixed": [[8192, 512], [4096, 2048, 2560], [3000, 3000, 2704]],
    "long": [[8704], [6000, 2704], [8192, 512]],
}


def setting(docs, dev):
    cfg = preset_config("mini")
    B, R = len(docs), sum(docs[0])
    pos = torch.cat(
        [torch.arange(n) for row in docs for n in row]
    )  # [B * R] each token's place in its document
    doc = torch.cat([torch.full((n,), i) for row in docs for i, n in enumerate(row)]).view(B, R).to(dev)
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(R, R, dtype=torch.bool, device=dev).tril()
    g = torch.Generator(device=dev).manual_seed(0)
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    q_i = torch.randn(B, R, HI, DI, device=dev, generator=g).to(torch.bfloat16)
    w_i = torch.randn(B, R, HI, device=dev, generator=g) * HI**-0.5
    k_i = torch.randn(B, R, DI, device=dev, generator=g).to(torch.bfloat16)
    layer = SimpleNamespace(indexer=Indexer(cfg).to(dev))  # what _select_rows reads of its layer
    ctx = SimpleNamespace(extras={}, host_positions=lambda: pos)
    return layer, ctx, (q_i, w_i, k_i), allowed, pos.view(B, R)


def session30(layer, picks_by_row, qwk, allowed, stages=None):
    """The selection as session 30 ran it, with CUDA events between its stages when `stages` is a dict; each
    row's picked queries come on the device, made before the timing (the layer caches its own per forward)."""
    q_i, w_i, k_i = qwk
    B, R, k = allowed.shape[0], allowed.shape[1], layer.indexer.topk
    topk, ev = fast_topk(allowed.device), [torch.cuda.Event(enable_timing=True) for _ in range(7)]
    names = ["scores", "gather_visible", "masked_fill", "topk", "selection_mask", "and_put"]
    for b in range(B):
        picks = picks_by_row[b]
        ev[0].record()
        scores = layer.indexer.row_scores_triton(q_i[b], w_i[b], k_i[b], picks)
        ev[1].record()
        visible = allowed[b, picks]
        ev[2].record()
        scores.masked_fill_(~visible, float("nan"))
        ev[3].record()
        chosen = topk(scores, picks + 1, k)
        ev[4].record()
        mask = selection_mask(chosen, R)
        ev[5].record()
        allowed[b, picks] = visible & mask
        ev[6].record()
        if stages is not None:
            torch.cuda.synchronize()
            for i, name in enumerate(names):
                stages[name] = stages.get(name, 0.0) + ev[i].elapsed_time(ev[i + 1])


def timed(fn, allowed, *args, reps=7):
    """Median ms of fn(*args, a fresh copy of allowed), and that copy as the last run left it."""
    times = []
    for _ in range(reps):
        a = allowed.clone()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(*args, a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times), a


def main():
    dev = torch.device("cuda")
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "shapes": "mini: 16 x 128 indexer heads, bf16 queries and keys, top-2048; ms for one layer's 3 rows",
    }
    for name, docs in DOCS.items():
        layer, ctx, qwk, allowed, pos = setting(docs, dev)
        new_ms, new = timed(MLAttention._select_rows, allowed, layer, ctx, *qwk)
        picks_by_row = [(p >= layer.indexer.topk).nonzero()[:, 0].to(dev) for p in pos]
        old_ms, old = timed(session30, allowed, layer, picks_by_row, qwk)
        stages = {}
        for _ in range(3):
            session30(layer, picks_by_row, qwk, allowed.clone(), stages)
        result[name] = {
            "docs": docs,
            "picked_queries": int((pos >= layer.indexer.topk).sum()),
            "layer_path_ms": new_ms,
            "session30_ms": old_ms,
            "speedup": old_ms / new_ms,
            "session30_stages_ms": {k: v / 3 for k, v in stages.items()},
            "same_mask": bool(torch.equal(new, old)),
            "kept_per_deep_query_max": int(new.sum(-1).max()),
        }
        print(name, json.dumps(result[name]), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "dsa_select_check.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(result[n]["same_mask"] for n in DOCS) else 1


if __name__ == "__main__":
    sys.exit(main())
