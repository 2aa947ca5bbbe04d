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
    peer, graph = extra.get("peer_ms"), extra.get("graph_ms")
    print(
        f"{name:44s} {ms * 1000:9.1f} us  {bw:6.2f} TB/s ({out['bandwidth_of_copy']:5.1%} of copy)"
        + (f"  peer {peer * 1000:9.1f} us  x{peer / ms:5.2f}" if peer else "")
        + (f"  graph {graph * 1000:7.1f} us" if graph else ""),
        flush=True,
    )
    return out


def _sweep(fns: dict, device: str, err_name: str, err) -> dict:
    """Each of `fns` (name -> a call of one kernel configuration) timed, with err(fn) under `err_name`: how far
    its answer is from the reference. A configuration that fails (a tile that does not fit in shared memory
    fails to compile) is recorded with its error, and the others still run."""
    out = {}
    for name, fn in fns.items():
        try:
            out[name] = {"ms": time_ms(fn, device), err_name: err(fn)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": repr(e)[:300]}
    return out


def _graph_ms(calls: list) -> float:
    """Milliseconds per call of `calls` captured in one CUDA graph and replayed, as decode runs them (no Python
    launch cost); give each call its own weights, so that one call's working set is not in L2 for the next."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: compilation, the allocator
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_ms(graph.replay) / len(calls)


def _topk_scores(kind: str, rows: int, length: int, device: str) -> torch.Tensor:
    """Scores [rows, length] of one shape of distribution: `randn`; `ramp`, randn plus a rise toward the end of
    the row (the largest crowd into its last quarter, as recent tokens often score); `ties`, integers 0-299
    (the k-th value is shared by hundreds of positions)."""
    if kind == "randn":
        return torch.randn(rows, length, device=device)
    if kind == "ramp":
        return torch.randn(rows, length, device=device) + torch.linspace(0, 6, length, device=device)
    if kind == "ties":
        return torch.randint(0, 300, (rows, length), device=device).float()
    raise ValueError(f"unknown score kind {kind!r}: randn, ramp or ties")


def bench_topk(
    ceilings: dict,
    rows: int = 64,
    length: int = 131072,
    k: int = 2048,
    kind: str = "randn",
    device: str = "cuda",
) -> dict:
    """The exact top-k `fast_topk` picks (KESTREL_DSA_TOPK: Triton's, or the CUDA kernel) against torch.topk,
    with Triton's beside it when the pick is the CUDA one."""
    from kestrel.ops.dsa import fast_topk
    from kestrel.ops.dsa.naive import topk_select
    from kestrel.ops.dsa.triton_topk import topk_triton

    topk = fast_topk(torch.device(device))
    scores = _topk_scores(kind, rows, length, device)
    lens = torch.full((rows,), length, device=device, dtype=torch.int64)
    ms = time_ms(lambda: topk(scores, lens, k), device)
    peer_ms = time_ms(lambda: torch.topk(scores, k, dim=-1), device)
    ours = topk(scores, lens, k)
    # the reference on 4 rows (every row has > k positions: no -1 to place); the kernel lists by position
    exact = bool(torch.equal(ours[:4], topk_select(scores[:4], lens[:4] - 1, k).sort(-1).values))
    # torch.topk breaks ties its own way: compare the sets only where no tie crosses the threshold
    if kind == "ties":
        same_sets = None
    else:
        same_sets = bool(
            (ours.sort(-1).values == torch.topk(scores, k, dim=-1).indices.sort(-1).values).all()
        )
    triton = {}
    if topk is not topk_triton:
        triton["ms"] = time_ms(lambda: topk_triton(scores, lens, k), device)
        triton["equals_default"] = bool(torch.equal(topk_triton(scores, lens, k), ours))
    graphs = {}
    if torch.device(device).type == "cuda":
        # in CUDA graphs, as decode runs it (no launch cost), each call on its own scores (a batch of scores
        # fits in L2): the default kernel, Triton's at several tile sizes (seg, block), torch.topk
        batches = [_topk_scores(kind, rows, length, device) for _ in range(4)]
        graphs["torch_topk_us"] = 1000 * _graph_ms([lambda s=s: torch.topk(s, k, dim=-1) for s in batches])
        graphs["ours_us"] = 1000 * _graph_ms([lambda s=s: topk(s, lens, k) for s in batches])
        for seg, block in ((4096, 2048), (4096, 4096), (8192, 4096), (16384, 4096), (32768, 4096)):
            calls = [lambda s=s, g=seg, b=block: topk_triton(s, lens, k, seg=g, block=b) for s in batches]
            graphs[f"triton_seg{seg}_block{block}_us"] = 1000 * _graph_ms(calls)
    return _entry(
        f"exact top-{k} of {rows}x{length} {kind}",
        ms,
        rows * length * 4 + rows * k * 8,
        0,
        ceilings,
        peer="torch.topk",
        peer_ms=peer_ms,
        implementation=f"{topk.__module__}.{topk.__name__}",
        same_sets_as_torch=same_sets,
        equals_reference=exact,
        triton=triton or None,
        stages_us=_stage_times(lambda: topk(scores, lens, k), device),
        in_graphs=graphs,
    )


def _stage_times(fn, device: str) -> dict | None:
    """GPU time of each kernel one call of `fn` launches (torch.profiler), to see which stage dominates."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:60]: e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0}


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


def bench_indexer_prefill(
    ceilings: dict, tokens: int, context: int, heads: int, dim: int, page: int = 64, device: str = "cuda"
) -> dict:
    """A prefill chunk's indexer scores: `tokens` query rows at the end of a `context`-token sequence, each with
    its causal length; the peer is the per-row (decode) kernel on the same rows, as prefill ran it before."""
    from kestrel.ops.dsa.triton_scores import indexer_scores_paged_triton, indexer_scores_prefill_triton

    pages = -(-context // page)
    pool = torch.randn(pages * page + page, dim, device=device, dtype=torch.bfloat16)
    row = torch.arange(1, pages + 1, device=device, dtype=torch.int64)  # [pages], page 0 the dummy
    lens = torch.arange(context - tokens + 1, context + 1, device=device)  # [tokens] causal lengths
    q = torch.randn(tokens, heads, dim, device=device, dtype=torch.bfloat16)
    w = torch.randn(tokens, heads, device=device, dtype=torch.bfloat16)
    new = lambda: indexer_scores_prefill_triton(q, pool, row, lens, w, dim**-0.5, page_size=page)  # noqa: E731
    old = lambda: indexer_scores_paged_triton(  # noqa: E731
        q, pool, row.expand(tokens, -1), lens, w, dim**-0.5, page_size=page
    )
    torch.testing.assert_close(new(), old(), rtol=1e-3, atol=1e-3, equal_nan=True)
    ms, peer_ms = time_ms(new, device), time_ms(old, device)
    visible = float(lens.sum())  # (row, key) pairs scored
    return _entry(
        f"indexer scores prefill t={tokens} ctx={context} HI={heads}",
        ms,
        context * dim * 2 + tokens * (heads * dim * 2 + context * 4),  # keys once, queries, the scores
        2 * visible * heads * dim,
        ceilings,
        peer="the per-row (decode) kernel",
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


def bench_sparse_mla_prefill(
    ceilings: dict,
    tokens: int,
    k: int,
    context: int | None = None,
    heads: int = 16,
    page: int = 64,
    device: str = "cuda",
) -> dict:
    """Sparse MLA of a prefill chunk: the last `tokens` query rows of a `context`-token sequence (default: the
    whole sequence), each over a random causal top-k in the top-k kernel's layout (its min(k, position + 1)
    entries first, then -1), at `mini`'s sizes. Three kernels on the same inputs, each checked against the first:
    - rows: the decode kernel with every row a query, as prefill runs past the expanded kernel's threshold (the
      default tile, without and with valid_first, then a sweep of tiles);
    - expanded (kestrel.ops.mla.triton_prefill_expanded): per-head keys and values expanded from the latent rows
      (W_UK, W_UV; their GEMMs inside the time), blocks of queries of one head share each key tile, the
      selection a mask; a sweep of tiles, and the same kernel without a selection (causal: its dense ceiling).
    FLOPs are the rows kernel's, absorbed form over the selected pairs, for every entry."""
    from kestrel.ops.mla.triton_decode import absorbed, sparse_mla_decode
    from kestrel.ops.mla.triton_prefill_expanded import sparse_mla_prefill_expanded

    R, P, Dn, Dv = 512, 64, 128, 128
    context = context or tokens
    q0 = context - tokens
    dt = torch.bfloat16
    pages = -(-context // page)
    pool = torch.randn(pages * page + page, R + P, device=device, dtype=dt)
    page_ids = torch.arange(1, pages + 1, device=device)
    table = page_ids.expand(tokens, -1).to(torch.int64)  # [T, pages]
    lens = torch.arange(q0 + 1, context + 1, device=device)  # [T] row t sees positions 0..q0 + t
    q_nope = torch.randn(tokens, heads, Dn, device=device, dtype=dt)
    q_pe = torch.randn(tokens, heads, P, device=device, dtype=dt)
    w_uk = torch.randn(heads, Dn, R, device=device, dtype=dt) * R**-0.5
    w_uv = torch.randn(heads, Dv, R, device=device, dtype=dt) * R**-0.5
    pos = torch.arange(context, device=device)
    key = torch.rand(tokens, context, device=device).masked_fill(pos[None, :] > lens[:, None] - 1, -1.0)
    top = key.topk(min(k, context), dim=-1)  # [T, k]: random causal selections
    idx = torch.where(top.values >= 0, top.indices, -1).sort(-1, descending=True).values  # valid first
    del key, top
    scale = (Dn + P) ** -0.5
    kv = pool[page : page + context]  # the sequence's rows (pages 1.. in order)

    def rows(**kw):
        return lambda: absorbed(
            q_nope,
            w_uk,
            w_uv,
            lambda q_lat, out: out.copy_(
                sparse_mla_decode(q_lat, q_pe, pool, table, page, lens, idx, scale, **kw)
            ),
        )

    ref = rows(valid_first=True)().float()

    def check(fn) -> float:
        return float((fn().float() - ref).abs().max() / ref.abs().max())

    tiles = ((32, 4, 2), (64, 4, 2), (32, 4, 3), (64, 8, 2))
    sweep = _sweep(
        {
            f"block_n{bn}_warps{warps}_stages{stages}": rows(
                block_n=bn, num_warps=warps, num_stages=stages, valid_first=True
            )
            for bn, warps, stages in tiles
        },
        device,
        "rel_err",
        check,
    )
    peer_ms = time_ms(rows(), device)
    ms = sweep["block_n32_warps4_stages2"]["ms"]

    def expanded_fn(bm, bn, warps, stages):
        return lambda: sparse_mla_prefill_expanded(
            q_nope,
            q_pe,
            kv,
            w_uk,
            w_uv,
            scale,
            idx,
            block_m=bm,
            block_n=bn,
            num_warps=warps,
            num_stages=stages,
        )

    tiles = ((128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2))
    expanded = _sweep(
        {
            f"block_m{bm}_block_n{bn}_warps{w}_stages{st}": expanded_fn(bm, bn, w, st)
            for bm, bn, w, st in tiles
        },
        device,
        "rel_err",
        check,
    )
    causal = lambda: sparse_mla_prefill_expanded(q_nope, q_pe, kv, w_uk, w_uv, scale)  # noqa: E731
    try:
        expanded["causal_no_selection"] = {"ms": time_ms(causal, device)}
    except Exception as e:  # noqa: BLE001
        expanded["causal_no_selection"] = {"ms": float("nan"), "error": repr(e)[:300]}
    ok = [v["ms"] for key_, v in expanded.items() if "ms" in v and key_ != "causal_no_selection"]
    print(
        f"    expanded kernel: best {min(ok, default=float('nan')) * 1000:.1f} us (rows kernel {ms * 1000:.1f} us,"
        f" causal without selection {expanded['causal_no_selection']['ms'] * 1000:.1f} us)",
        flush=True,
    )

    read = float(lens.clamp(max=k).sum())  # (row, selected position) pairs
    return _entry(
        f"sparse MLA prefill t={tokens} ctx={context} top-{k} (rows, valid first)",
        ms,
        read * (R + P) * 2,
        2 * read * heads * (R + P + R),
        ceilings,
        peer="the same without valid_first (every row over all k slots)",
        peer_ms=peer_ms,
        sweep=sweep,
        expanded_kernel=expanded,
    )


def bench_moe(
    ceilings: dict,
    tokens: int,
    experts: int = 64,
    top_k: int = 6,
    hidden: int = 2048,
    inter: int = 256,
    device: str = "cuda",
) -> list[dict]:
    """The routed experts at `mini`'s sizes: the grouped path (torch._grouped_mm), then the Triton decode path
    beside it (its peer: the grouped time, and how far apart the two answers are). On CUDA also `graph_ms`: each
    path replayed in a CUDA graph of 8 calls on 8 weight copies (1.6 GB at mini's sizes), the time decode sees."""
    from kestrel.ops.moe.grouped import moe_experts_grouped
    from kestrel.ops.moe.triton_experts import moe_experts_triton

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02
    ids = torch.rand(tokens, experts, device=device).argsort(-1)[:, :top_k]  # [T, A] distinct per token
    weights = torch.rand(tokens, top_k, device=device)
    grouped_ms = time_ms(lambda: moe_experts_grouped(x, w13, w2, weights, ids, "silu"), device)
    # the grouped path's end in torch (fp32 copies, a scatter back to pair order, a sum) instead of one kernel
    torch_combine_ms = time_ms(
        lambda: moe_experts_grouped(x, w13, w2, weights, ids, "silu", triton_combine=False), device
    )
    triton_ms = time_ms(lambda: moe_experts_triton(x, w13, w2, weights, ids, "silu"), device)
    graph: dict = {"grouped": {}, "triton": {}}
    if torch.device(device).type == "cuda":
        layers = [(w13, w2)] + [(torch.randn_like(w13) * 0.02, torch.randn_like(w2) * 0.02) for _ in range(7)]
        for key, fn in (("grouped", moe_experts_grouped), ("triton", moe_experts_triton)):
            calls = [lambda a=a, b=b, fn=fn: fn(x, a, b, weights, ids, "silu") for a, b in layers]
            try:  # the eager figures still come back if a capture fails
                graph[key] = {"graph_ms": _graph_ms(calls)}
            except RuntimeError as e:
                graph[key] = {"graph_error": repr(e)[:300]}
        del layers
    a = moe_experts_grouped(x, w13, w2, weights, ids, "silu").float()
    b = moe_experts_triton(x, w13, w2, weights, ids, "silu").float()
    rel_err = float((a - b).norm() / a.norm().clamp_min(1e-30))
    hit = int(ids.unique().numel())
    nbytes = hit * 3 * hidden * inter * 2 + 2 * tokens * hidden * 2
    flops = 2 * tokens * top_k * 3 * hidden * inter
    shape = f"T={tokens} E={experts} k={top_k}"
    return [
        _entry(
            f"grouped MoE experts {shape}",
            grouped_ms,
            nbytes,
            flops,
            ceilings,
            experts_hit=hit,
            peer="moe_experts_grouped with its torch combine (fp32 copies, scatter, sum)",
            peer_ms=torch_combine_ms,
            **graph["grouped"],
        ),
        _entry(
            f"fused MoE decode (triton) {shape}",
            triton_ms,
            nbytes,
            flops,
            ceilings,
            experts_hit=hit,
            peer="moe_experts_grouped",
            peer_ms=grouped_ms,
            rel_err_vs_peer=rel_err,
            **graph["triton"],
        ),
    ]


def bench_router(
    ceilings: dict, tokens: int, experts: int = 64, top_k: int = 6, hidden: int = 2048, device: str = "cuda"
) -> dict:
    """The MoE router from the hidden states at `mini`'s sizes (decode's path: logits and routing in Triton).
    Peer: the path above the decode sizes, the router GEMM (on CUDA one bf16 GEMM over the weight's exact
    three-way split, `Router.inference_logits`; else the fp32 matmul) then the routing kernel adding its parts.
    Both in CUDA graphs of 8 layers' calls on CUDA, as decode replays them."""
    from kestrel.ops.moe.router_gemm import mm_fp32_out_works, router_logit_parts_bf16x3, split_bf16x3
    from kestrel.ops.moe.triton_router import route_hidden_triton, route_triton

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(experts, hidden, device=device) * hidden**-0.5 for _ in range(8)]
    bias = torch.randn(experts, device=device) * 0.1
    split = mm_fp32_out_works(x.device)
    parts = {w.data_ptr(): split_bf16x3(w) for w in weights} if split else {}

    def fused(w):
        return route_hidden_triton(x, w, bias, top_k, True, 2.5)

    def gemm_then_route(w):
        logits = router_logit_parts_bf16x3(x, parts[w.data_ptr()]) if split else x.float() @ w.t()
        return route_triton(logits, bias, top_k, True, 2.5)

    ms, peer_ms = (
        time_ms(lambda: fused(weights[0]), device),
        time_ms(lambda: gemm_then_route(weights[0]), device),
    )
    extra = {}
    if torch.device(device).type == "cuda":
        extra["graph_ms"] = _graph_ms([lambda w=w: fused(w) for w in weights])
        extra["peer_graph_ms"] = _graph_ms([lambda w=w: gemm_then_route(w) for w in weights])
    same = torch.equal(fused(weights[0])[1], gemm_then_route(weights[0])[1])
    return _entry(
        f"MoE router from hidden T={tokens} E={experts} D={hidden}",
        ms,
        experts * hidden * 4 + tokens * hidden * 2,
        2 * tokens * experts * hidden,
        ceilings,
        peer="router GEMM (bf16 x3 split on CUDA), then the routing kernel",
        peer_ms=peer_ms,
        same_experts_as_peer=same,
        **extra,
    )


def bench_kda_decode(
    ceilings: dict, batch: int, heads: int = 8, dim: int = 128, device: str = "cuda"
) -> dict:
    from kestrel.ops.kda import get_kda_backend

    # the step the decode path runs (on CUDA, ours unless KESTREL_KDA_DECODE=fla)
    recurrent_inplace = get_kda_backend(torch.device(device)).recurrent_inplace
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


def bench_kda_conv_prefill(
    ceilings: dict, tokens: int, seqs: int = 8, channels: int = 3072, width: int = 4232, device: str = "cuda"
) -> dict:
    """The KDA short conv of a packed prefill (Triton, kestrel.ops.kda.triton_conv.short_conv_prefill) at mini's
    sizes: q|k|v channels read as a column slice of the merged input projection's rows (`width` wide), `seqs`
    sequences packed, no prior state. The default tile, then a sweep of tiles; bytes: x read and y written."""
    from kestrel.ops.kda.triton_conv import short_conv_prefill

    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)[:, :channels]
    weight = torch.randn(channels, 4, device=device, dtype=torch.bfloat16)
    cu = torch.linspace(0, tokens, seqs + 1, device=device).long()
    ref = short_conv_prefill(x, weight, None, cu)[0].float()
    tiles = ((16, 256, 4), (64, 128, 4), (32, 128, 8), (16, 512, 8), (8, 256, 2), (16, 128, 2))
    sweep = _sweep(
        {
            f"block_t{bt}_block_c{bc}_warps{w}": lambda bt=bt, bc=bc, w=w: short_conv_prefill(
                x, weight, None, cu, block_t=bt, block_c=bc, num_warps=w
            )
            for bt, bc, w in tiles
        },
        device,
        "max_abs_vs_default",
        lambda fn: float((fn()[0].float() - ref).abs().max()),
    )
    ms = sweep["block_t16_block_c256_warps4"]["ms"]
    # as the engine calls it: each sequence's conv state (its last W - 1 inputs) from the state pool
    state = torch.randn(seqs, channels, 3, device=device, dtype=torch.bfloat16)
    with_state = time_ms(lambda: short_conv_prefill(x, weight, state, cu), device)
    return _entry(
        f"KDA conv prefill T={tokens} C={channels}",
        ms,
        2 * tokens * channels * 2,
        0,
        ceilings,
        sweep=sweep,
        with_state_ms=with_state,
    )


# The shapes of `kestrel bench kernels` (the H200's): keyword arguments of each bench_* function.
KERNEL_CASES = {
    "topk": [{}, {"kind": "ramp"}, {"kind": "ties"}],
    "indexer": [
        {"batch": b, "context": c, "heads": 16, "dim": 128} for b, c in ((1, 4096), (64, 4096), (64, 131072))
    ],
    "indexer_prefill": [
        {"tokens": t, "context": c, "heads": 16, "dim": 128} for t, c in ((4096, 4096), (8192, 32768))
    ],
    "sparse_mla": [
        {"batch": b, "context": c, "k": k}
        for b, c, k in ((1, 4096, 2048), (64, 4096, 2048), (64, 131072, 2048), (64, 4096, None))
    ],
    # the last three: short chunks after a long history, where `use_expanded`'s expansion term (an estimate) decides
    "sparse_mla_prefill": [
        {"tokens": t, "context": c, "k": 2048}
        for t, c in ((4096, 4096), (4096, 16384), (4096, 32768), (64, 8192), (512, 32768), (1, 32768))
    ],
    "router": [{"tokens": t} for t in (1, 64, 128, 256, 512)],
    "moe": [{"tokens": t} for t in (1, 64, 256, 1024, 2048, 4096, 8192, 32768)],
    "kda_decode": [{"batch": b} for b in (1, 64, 256)],
    "kda_conv_prefill": [{"tokens": 32768}],
}
_BENCHES = {
    "topk": bench_topk,
    "indexer": bench_indexer,
    "indexer_prefill": bench_indexer_prefill,
    "sparse_mla": bench_sparse_mla,
    "sparse_mla_prefill": bench_sparse_mla_prefill,
    "router": bench_router,
    "moe": bench_moe,
    "kda_decode": bench_kda_decode,
    "kda_conv_prefill": bench_kda_conv_prefill,
}


@torch.no_grad()  # inference, as the engine runs them (the MoE grouped path picks its combine by it)
def kernels_bench(device: str = "cuda", cases: dict = KERNEL_CASES) -> dict:
    """Every case of `cases` on `device`: CUDA, or the CPU with the kernels in Triton's interpreter
    (TRITON_INTERPRET=1, the smoke run of scripts/gpu_suite.py at tiny shapes)."""
    if torch.device(device).type == "cuda":
        require_cuda("kestrel bench kernels")
    ceilings = measure_ceilings(device)
    print(
        f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    results = []
    for name, kws in cases.items():
        for kw in kws:
            result = _BENCHES[name](ceilings, **kw, device=device)  # one row, or several side by side
            results += result if isinstance(result, list) else [result]
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
