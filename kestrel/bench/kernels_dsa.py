"""`kestrel bench kernels`: the DSA kernels (exact top-k, indexer scores for decode and prefill, sparse MLA
decode and prefill), each against its plain-PyTorch peer."""

from __future__ import annotations

import torch

from kestrel.bench.measure import kernel_row, stage_times, time_configs
from kestrel.bench.roofline import graph_ms, time_ms


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
        graphs["torch_topk_us"] = 1000 * graph_ms([lambda s=s: torch.topk(s, k, dim=-1) for s in batches])
        graphs["ours_us"] = 1000 * graph_ms([lambda s=s: topk(s, lens, k) for s in batches])
        for seg, block in ((4096, 2048), (4096, 4096), (8192, 4096), (16384, 4096), (32768, 4096)):
            calls = [lambda s=s, g=seg, b=block: topk_triton(s, lens, k, seg=g, block=b) for s in batches]
            graphs[f"triton_seg{seg}_block{block}_us"] = 1000 * graph_ms(calls)
    return kernel_row(
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
        stages_us=stage_times(lambda: topk(scores, lens, k), device),
        in_graphs=graphs,
    )


def bench_indexer(
    ceilings: dict, batch: int, context: int, heads: int, dim: int, page: int = 64, device: str = "cuda"
) -> dict:
    """Decode's indexer scores (fill_past=False, as the layer calls them) over full rows of `context` keys."""
    from kestrel.ops.dsa.naive import indexer_scores_batched
    from kestrel.ops.dsa.triton_scores import indexer_scores_paged_triton

    pages = -(-context // page)
    pool = torch.randn(batch * pages * page + page, dim, device=device, dtype=torch.bfloat16)
    table = (torch.arange(batch * pages, device=device).view(batch, pages) + 1).to(torch.int64)
    lens = torch.full((batch,), context, device=device, dtype=torch.int64)
    q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
    w = torch.randn(batch, heads, device=device)
    ms = time_ms(
        lambda: indexer_scores_paged_triton(
            q, pool, table, lens, w, dim**-0.5, page_size=page, fill_past=False
        ),
        device,
    )
    keys = pool.view(-1, page, dim)[table].reshape(batch, pages * page, dim)
    peer_ms = time_ms(lambda: indexer_scores_batched(q, keys, w, dim**-0.5), device)
    nbytes = batch * context * (dim * 2 + 4)
    return kernel_row(
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
    return kernel_row(
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
    return kernel_row(name, ms, nbytes, flops, ceilings)


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
    sweep = time_configs(
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
    expanded = time_configs(
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
    return kernel_row(
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
