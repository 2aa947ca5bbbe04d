"""Training's MLA attention over row-packed documents, forward and backward, at `mini`'s sizes by default (16 heads,
query and key width 192, value width 128): the dense masked SDPA (cuDNN on the H200, every pair of the row) beside
FlexAttention over the mask's visible blocks (`kestrel.ops.mla.flex_rows`) with torch's default tiles, with the
tuned ones training runs (`tuned_options`) and with each other set of `--configs` tiles, warps and stages. The
documents are a real batch of `kestrel train`'s mixture (the shipped tokenizer, retrieval at 2K and 8K), so the
block sparsity is the training loop's.

Each variant's output and gradients are checked against SDPA's before it is timed (`max_err`: the largest
difference over o, dq, dk, dv, relative to each tensor's largest value). FLOPs count the pairs the documents need
(each document causal on its own): 4 * H * (Dq + Dv) / 2 per pair forward, 2.5 times that backward. The bf16
matmul ceiling is measured in the same run.

    python3 scripts/bench_train_attention.py --out $OUT/train_attention.json   # H200
    python3 scripts/bench_train_attention.py --rows 8 --heads 6 --qk-dim 96 --v-dim 64 --configs default,tuned
                                                                               # the demo's sizes
    python3 scripts/bench_train_attention.py --smoke                           # CPU: tiny sizes, forward only
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.bench.roofline import device_name, measure_ceilings, time_ms  # noqa: E402
from kestrel.ops.mla.flex_rows import flex_attention_rows  # noqa: E402
from kestrel.utils.fuse import raise_recompile_limit  # noqa: E402


def _bwd(m1: int, n1: int, stages: int, warps: int, **extra) -> dict:
    """Backward tiles: BLOCK_M1 x BLOCK_N1 for dk/dv, BLOCK_M2 = n1 x BLOCK_N2 = m1 for dq (flex asserts
    N1 % M1 == 0 and M2 % N2 == 0)."""
    return {
        "bwd_BLOCK_M1": m1,
        "bwd_BLOCK_N1": n1,
        "bwd_BLOCK_M2": n1,
        "bwd_BLOCK_N2": m1,
        "bwd_num_stages": stages,
        "bwd_num_warps": warps,
        **extra,
    }


def _fwd(m: int, n: int, stages: int, warps: int) -> dict:
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_stages": stages, "fwd_num_warps": warps}


CONFIGS = {
    "default": {},  # torch's
    "tuned": None,  # flex_rows.tuned_options: what training runs
    "bwd 64x128 s3 w8": _bwd(64, 128, 3, 8),
    "bwd 64x128 s2 w8": _bwd(64, 128, 2, 8),
    "bwd 64x64 s3 w4": _bwd(64, 64, 3, 4),
    "bwd 64x64 s2 w8": _bwd(64, 64, 2, 8),
    "bwd 32x64 s3 w4": _bwd(32, 64, 3, 4),
    "bwd 32x128 s3 w8": _bwd(32, 128, 3, 8),
    "bwd 64x128 s2 w8 tma": _bwd(64, 128, 2, 8, USE_TMA=True),
    "fwd 128x128 s2 w8": _fwd(128, 128, 2, 8),
    "fwd 64x128 s3 w4": _fwd(64, 128, 3, 4),
}


def document_lengths(rows: int, row_len: int) -> list[list[int]]:
    """Each row's document lengths in one batch of the training mixture (padding is a document of its own)."""
    from kestrel.config import TrainConfig
    from kestrel.presets import shipped_model_dir
    from kestrel.train.data import DEFAULT_WEIGHTS, MixtureConfig, PackedBatches
    from kestrel.train.trainer import mixture_config

    if row_len > 8192:  # as `kestrel train` and profile_train.py draw them
        mix = mixture_config(
            TrainConfig(
                out_dir=tempfile.mkdtemp(), batch_rows=rows, row_len=row_len, retrieval_lengths=(2048, 8192)
            )
        )
    else:  # --smoke: rows too short for retrieval prompts
        mix = MixtureConfig(weights={**DEFAULT_WEIGHTS, "retrieval": 0.0})
    data = PackedBatches(str(shipped_model_dir()), rows, row_len, mix)
    try:
        bounds = next(data).cu_seqlens.tolist()
    finally:
        data.close()
    docs = [[] for _ in range(rows)]
    for a, b in zip(bounds, bounds[1:]):
        docs[a // row_len].append(b - a)
    return docs


def document_causal(docs: list[list[int]], row_len: int, device) -> torch.Tensor:
    """[B, R, R] bool: the visibility `MLAttention._attend_rows` builds (each document causal on its own), by the
    layer's own function."""
    from kestrel.layers.context import ForwardContext
    from kestrel.layers.mla import _build_document_causal

    ctx = ForwardContext.build([n for row in docs for n in row], device=device)
    return _build_document_causal(ctx, len(docs), row_len)


def _sdpa(q, k, v, allowed, scale):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale)


def _max_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(got, ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--row-len", type=int, default=8704)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--qk-dim", type=int, default=192, help="query/key width (mini: 192; demo: 96)")
    ap.add_argument("--v-dim", type=int, default=128, help="value width (mini: 128; demo: 64)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, forward only (runs on the CPU)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    names = args.configs.split(",")
    if set(names) - set(CONFIGS):
        ap.error(f"--configs: unknown {sorted(set(names) - set(CONFIGS))}; choose from {', '.join(CONFIGS)}")
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    rows, row_len, H = (1, 512, 2) if args.smoke else (args.rows, args.row_len, args.heads)
    if row_len % 128:
        ap.error(f"--row-len must be a multiple of flex's 128-token blocks (got {row_len})")
    Dq, Dv = args.qk_dim, args.v_dim
    scale = Dq**-0.5
    torch.manual_seed(0)
    docs = document_lengths(rows, row_len)
    allowed = document_causal(docs, row_len, device)
    pairs = allowed.sum().item()
    fwd_flops = pairs * H * 2 * (Dq + Dv)
    dtype = torch.bfloat16 if cuda else torch.float32
    q = torch.randn(rows, H, row_len, Dq, device=device, dtype=dtype, requires_grad=cuda)
    k = torch.randn(rows, H, row_len, Dq, device=device, dtype=dtype, requires_grad=cuda)
    v = torch.randn(rows, H, row_len, Dv, device=device, dtype=dtype, requires_grad=cuda)
    grad = torch.randn(rows, H, row_len, Dv, device=device, dtype=dtype)
    ceilings = measure_ceilings(device)
    raise_recompile_limit()  # one compiled graph per kernel option set

    def grads(fn):
        q.grad = k.grad = v.grad = None
        o = fn()
        if not cuda:
            return [o]
        o.backward(grad)
        return [o, q.grad, k.grad, v.grad]

    def fresh_backward(fn):  # no accumulation into the last call's gradients inside the timing
        q.grad = k.grad = v.grad = None
        fn().backward(grad)

    variants = {"sdpa (dense mask)": lambda: _sdpa(q, k, v, allowed, scale)}
    for name in names:
        variants[f"flex {name}"] = lambda opts=CONFIGS[name]: flex_attention_rows(
            q, k, v, allowed, scale, compiled=cuda, kernel_options=opts
        )
    reference, results = None, []
    for name, fn in variants.items():
        row = {"variant": name}
        try:
            t0 = time.perf_counter()
            got = grads(fn)
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            if name.startswith("sdpa"):
                reference = [t.detach().clone() for t in got]
            row["max_err"] = _max_err(got, reference) if reference is not None else None
            row["fwd_ms"] = time_ms(fn, device)
            row["fwd_TFLOPs"] = fwd_flops / (row["fwd_ms"] * 1e-3) / 1e12
            if cuda:
                row["fwd_bwd_ms"] = time_ms(lambda fn=fn: fresh_backward(fn), device)
                row["fwd_bwd_TFLOPs"] = 3.5 * fwd_flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
        except Exception as exc:  # a tile set that does not fit (shared memory) or does not compile
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        results.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "shape": {"rows": rows, "row_len": row_len, "heads": H, "qk_dim": Dq, "v_dim": Dv},
        "documents_per_row": [len(d) for d in docs],
        "longest_document": max(max(d) for d in docs),
        "pairs_document_causal": pairs,
        "pairs_per_token_document_causal": pairs / (rows * row_len),
        "ceilings": ceilings,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
