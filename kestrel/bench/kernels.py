"""`kestrel bench kernels`: each fast-path kernel on the GPU — its time, the bytes it must move and its FLOPs,
the achieved bandwidth or FLOP rate against the ceilings measured in the same run, and, where one exists,
the plain-PyTorch peer timed beside it (with a check that both give the same answer)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch

from kestrel.bench.roofline import device_name, measure_ceilings, require_cuda, time_ms


def _entry(name: str, ms: float, nbytes: float, flops: float, ceilings: dict, **extra) -> dict:
    bw = nbytes / (ms * 1e-3) / 1e12
    rate = flops / (ms * 1e-3) / 1e12
    out = {
        "kernel": name,
        "ms": ms,
        "bytes": nbytes,
        "flops": flops,
        "TBps": bw,
        "bandwidth_of_copy": bw / ceilings["copy_TBps"],
        "TFLOPs": rate,
        "flops_of_matmul": rate / ceilings["bf16_matmul_TFLOPs"],
        **extra,
    }
    peer = extra.get("peer_ms")
    print(
        f"{name:44s} {ms * 1000:9.1f} us  {bw:6.2f} TB/s ({out['bandwidth_of_copy']:5.1%} of copy)"
        + (f"  peer {peer * 1000:9.1f} us  x{peer / ms:5.2f}" if peer else ""),
        flush=True,
    )
    return out


def bench_topk(
    ceilings: dict, rows: int = 64, length: int = 131072, k: int = 2048, device: str = "cuda"
) -> dict:
    from kestrel.ops.dsa.naive import topk_select
    from kestrel.ops.dsa.triton_topk import topk_triton

    scores = torch.randn(rows, length, device=device)
    lens = torch.full((rows,), length, device=device, dtype=torch.int64)
    ms = time_ms(lambda: topk_triton(scores, lens, k), device)
    peer_ms = time_ms(lambda: torch.topk(scores, k, dim=-1), device)
    ours = topk_triton(scores, lens, k)
    same_sets = bool((ours.sort(-1).values == torch.topk(scores, k, dim=-1).indices.sort(-1).values).all())
    exact = bool(torch.equal(ours[:4], topk_select(scores[:4], lens[:4] - 1, k)))  # the reference on 4 rows
    return _entry(
        f"exact top-{k} of {rows}x{length}",
        ms,
        rows * length * 4 + rows * k * 8,
        0,
        ceilings,
        peer="torch.topk",
        peer_ms=peer_ms,
        same_sets_as_torch=same_sets,
        equals_reference=exact,
    )


def bench_indexer(
    ceilings: dict, batch: int, context: int, heads: int, dim: int, page: int = 64, device: str = "cuda"
) -> dict:
    from kestrel.ops.dsa.naive import indexer_scores_batched
    from kestrel.ops.dsa.triton_scores import indexer_scores_paged_triton

    pages = -(-context // page)
    pool = torch.randn(batch * pages * page + page, dim, device=device, dtype=torch.bfloat16)
    table = (torch.arange(batch * pages, device=device).view(batch, pages) + 1).to(torch.int64)
    lens = torch.full((batch,), context, device=device, dtype=torch.int64)
    q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
    w = torch.randn(batch, heads, device=device)
    ms = time_ms(
        lambda: indexer_scores_paged_triton(q, pool, table, lens, w, dim**-0.5, page_size=page), device
    )
    keys = pool.view(-1, page, dim)[table].reshape(batch, pages * page, dim)
    peer_ms = time_ms(lambda: indexer_scores_batched(q, keys, w, dim**-0.5), device)
    nbytes = batch * context * (dim * 2 + 4)
    return _entry(
        f"indexer scores b={batch} ctx={context} HI={heads}",
        ms,
        nbytes,
        2 * batch * context * heads * dim,
        ceilings,
        peer="torch on gathered keys",
        peer_ms=peer_ms,
    )


def bench_sparse_mla(
    ceilings: dict,
    batch: int,
    context: int,
    k: int | None,
    heads: int = 16,
    page: int = 64,
    device: str = "cuda",
) -> dict:
    from kestrel.ops.mla.triton_decode import decode_bytes, sparse_mla_decode

    R, P = 512, 64
    pages = -(-context // page)
    pool = torch.randn(batch * pages * page + page, R + P, device=device, dtype=torch.bfloat16)
    table = (torch.arange(batch * pages, device=device).view(batch, pages) + 1).to(torch.int64)
    lens = torch.full((batch,), context, device=device, dtype=torch.int64)
    q_lat = torch.randn(batch, heads, R, device=device, dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, P, device=device, dtype=torch.bfloat16)
    idx = None
    if k is not None:
        idx = torch.stack([torch.randperm(context, device=device)[:k] for _ in range(batch)]).sort(-1).values
    ms = time_ms(
        lambda: sparse_mla_decode(q_lat, q_pe, pool, table, page, lens, idx, (128 + P) ** -0.5), device
    )
    nbytes = decode_bytes(batch, context, k, num_heads=heads, kv_lora_rank=R, rope_dim=P, page_size=page)
    read = min(k or context, context)
    flops = 2 * batch * heads * read * (R + P + R)
    name = f"{'sparse' if k else 'dense'} MLA decode b={batch} ctx={context}"
    return _entry(name, ms, nbytes, flops, ceilings)


def bench_moe(
    ceilings: dict,
    tokens: int,
    experts: int = 64,
    top_k: int = 6,
    hidden: int = 2048,
    inter: int = 256,
    device: str = "cuda",
) -> dict:
    from kestrel.ops.moe.grouped import moe_experts_grouped

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02
    ids = torch.stack([torch.randperm(experts, device=device)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=device)
    ms = time_ms(lambda: moe_experts_grouped(x, w13, w2, weights, ids, "silu"), device)
    hit = int(ids.unique().numel())
    nbytes = hit * 3 * hidden * inter * 2 + 2 * tokens * hidden * 2
    flops = 2 * tokens * top_k * 3 * hidden * inter
    return _entry(
        f"grouped MoE experts T={tokens} E={experts} k={top_k}", ms, nbytes, flops, ceilings, experts_hit=hit
    )


def bench_kda_decode(
    ceilings: dict, batch: int, heads: int = 8, dim: int = 128, device: str = "cuda"
) -> dict:
    from kestrel.ops.kda.fla import recurrent_inplace

    pool = torch.randn(batch + 1, heads, dim, dim, device=device) * 0.05
    slots = torch.arange(1, batch + 1, device=device)
    q, k, v = (torch.randn(batch, 1, heads, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(batch, 1, heads, dim, device=device)
    beta = torch.rand(batch, 1, heads, device=device)
    ms = time_ms(lambda: recurrent_inplace(q, k, v, g, beta, pool, slots, use_qk_l2norm=True), device)
    nbytes = 2 * batch * heads * dim * dim * 4
    return _entry(
        f"KDA decode in place N={batch} H={heads}", ms, nbytes, 4 * batch * heads * dim * dim, ceilings
    )


# The shapes of `kestrel bench kernels` (the H200's): keyword arguments of each bench_* function.
KERNEL_CASES = {
    "topk": [{}],
    "indexer": [
        {"batch": b, "context": c, "heads": 16, "dim": 128} for b, c in ((1, 4096), (64, 4096), (64, 131072))
    ],
    "sparse_mla": [
        {"batch": b, "context": c, "k": k}
        for b, c, k in ((1, 4096, 2048), (64, 4096, 2048), (64, 131072, 2048), (64, 4096, None))
    ],
    "moe": [{"tokens": t} for t in (1, 64, 256, 4096)],
    "kda_decode": [{"batch": b} for b in (1, 64, 256)],
}
_BENCHES = {
    "topk": bench_topk,
    "indexer": bench_indexer,
    "sparse_mla": bench_sparse_mla,
    "moe": bench_moe,
    "kda_decode": bench_kda_decode,
}


def kernels_bench(device: str = "cuda", cases: dict = KERNEL_CASES) -> dict:
    """Every case of `cases` on `device`: CUDA, or the CPU with the kernels in Triton's interpreter
    (TRITON_INTERPRET=1, the smoke run of scripts/gpu_suite.py at tiny shapes)."""
    if torch.device(device).type == "cuda":
        require_cuda("kestrel bench kernels")
    ceilings = measure_ceilings(device)
    print(
        f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    results = [_BENCHES[name](ceilings, **kw, device=device) for name, kws in cases.items() for kw in kws]
    return {
        "benchmark": "kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device_name(device),
        "torch": torch.__version__,
        "ceilings": ceilings,
        "kernels": results,
    }


def cmd_bench_kernels(args) -> int:
    result = kernels_bench()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
