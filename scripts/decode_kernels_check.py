"""The decode-step kernels that `bench decode --profile` found slow (H200, 2026-12-01, session 19), checked and
timed on the device in one run, one JSON result:

    export PYTHONPATH=$PWD; python3 scripts/decode_kernels_check.py --out $OUT/decode_kernels.json

1. `moe_sort`: the MoE pair sort (kestrel.ops.moe.triton_experts.sort_pairs). mini's batch-256 step spent
   0.87 ms in 24 calls of the one-program counting sort (36 us each at 1536 pairs). For M pairs of E experts
   (decode batches 1-341 at top-6 of mini's 64, and K3's top-8 of 384): the one-program sort, the
   program-per-block sort (`parallel=True`) and torch.sort + searchsorted (the path past 2048 pairs), each
   checked against torch.sort's stable order, then timed as the step runs them: 24 calls in one CUDA graph,
   the replay's microseconds / 24.
2. `mla_decode`: sparse MLA decode (kestrel.ops.mla.triton_decode.sparse_mla_decode) at mini's sizes (16 heads,
   rank 512, top-2048 of 4K), batch 1 / 64 / 256. The batch-256 step spent 2.20 ms in 6 calls (367 us each)
   where the latent rows it must read take 145 us at the copy rate. Its launch knobs (splits, block_n,
   num_warps, num_stages) are swept; every configuration's output is compared with the default's; each is timed
   with the L2 flushed against `decode_bytes` at the copy rate measured in the run.
3. `moe_tiles`: the routed experts' Triton tiles and pipeline depths at tokens 1, 64 and 256, the shared expert
   in the same launches (mini's batch-256 step: 73 us a layer against 48 us of expert bytes), gate_up's knobs
   and down's swept apart, each configuration checked against the default and timed in a CUDA graph of 8
   layers' weights.
4. `mla_layout`: sparse MLA decode over the same selected rows reached four ways (rows translated first; index ->
   page -> row in the loop; a page table of page size 1 holding the rows; consecutive pages) and a torch gather of
   those rows: where the time goes.
5. `kda_step`: the KDA decode step on the state slots, fla-core's kernel against ours (kestrel.ops.kda.triton_recurrent)
   over its tiles, 18 layers in a CUDA graph, against the state bytes at the copy rate.
6. `moe_anatomy`: the experts' weights read with no math, in gate_up's and down's tile order and grid, against
   the copy rate; and the whole experts call at batch 256 under random and balanced routing (the experts run at
   ~60% of their bytes and no tile changes that: session 21).
7. `small_kernels`: the AttnRes mix, the KDA conv step and the pair sort's knobs (block, warps) at batch 1 / 64 /
   256, against their bytes and the launch floor in the same graph.
8. `pdl`: a chain of 200 dependent decode kernels in one CUDA graph with programmatic dependent launch off and on
   (kestrel.ops.pdl), us a kernel.
9. `gemv`: decode's linear layers through cuBLAS against the Triton GEMV (kestrel.ops.linear), us a projection;
   and MLA's six projections of one input as six GEMV launches against one (`gemv_merged`).
10. `moe_fused`: the MoE layer at batch 1 in one launch (kestrel.ops.moe.triton_decode) against the six it replaces,
   its tiles and grid swept, us a layer in a graph of 24 layers against the bytes at the copy rate.
11. `l2_ahead`: batch 1's projections fed from L2: a chain of mini's KDA projections with cold weights, and with one
   layer's weights (hot: the ceiling of any prefetching); and the chain as one persistent launch that asks L2 for
   the stages ahead (kestrel.ops.linear.triton_chain), swept; and as one persistent CUDA launch whose blocks copy the
   weight rows of the stages ahead into shared memory while they wait (kestrel.ops.linear.cuda_chain), by depth.
12. `gemv_rows`: the GEMV's rows kernel (a program's whole weight slice in one load, before the PDL wait) against
   its K-loop kernel on batch 1-4's projections, swept.
Each section catches its own exceptions; the JSON is rewritten after every section. `--smoke` runs every section at
tiny sizes on the CPU under TRITON_INTERPRET=1 (the figures mean nothing there).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.bench.roofline import device_name, graph_ms, measure_ceilings, time_ms  # noqa: E402
from kestrel.env import env_overrides  # noqa: E402

CALLS_PER_STEP = 24  # mini's MoE layers: the sort runs once in each


def calls_us(calls: list, device: str) -> float:
    """Microseconds a call when `calls` (each its own weights, or one call repeated) replay in one CUDA graph,
    as in a decode step; on the CPU the wall-clock median of the first."""
    if device != "cuda":
        return 1000 * time_ms(calls[0], device)
    return 1000 * graph_ms(calls)


def graph_us(fn, device: str, calls: int = CALLS_PER_STEP) -> float:
    """Microseconds a call of fn() when `calls` of them replay in one CUDA graph (`calls_us`)."""
    return calls_us([fn] * calls, device)


def _torch_sort(ids: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sort past COUNTING_SORT_MAX_PAIRS: torch.sort, then each expert's first row by searchsorted."""
    s, o = torch.sort(ids, stable=True)
    return o, torch.searchsorted(s, bounds, out_int32=True)


def moe_sort(result: dict, device: str, smoke: bool) -> None:
    from kestrel.ops.moe.triton_experts import COUNTING_SORT_MAX_PAIRS, sort_pairs

    cases = [(6, 64), (96, 64), (384, 64), (1536, 64), (2046, 64), (8, 384), (512, 384), (2048, 384)]
    if smoke:
        cases = [(6, 8), (40, 8), (300, 16)]
    rows = result["moe_sort"] = {"counting_sort_max_pairs": COUNTING_SORT_MAX_PAIRS}
    for M, E in cases:
        g = torch.Generator(device=device).manual_seed(M + E)
        ids = torch.randint(0, E, (M,), generator=g, device=device)
        want_ids, want_order = torch.sort(ids, stable=True)
        bounds = torch.arange(E + 1, device=device)
        want_starts = torch.searchsorted(want_ids, bounds, out_int32=True)

        fns = {
            "one_program": functools.partial(sort_pairs, ids, E, parallel=False),
            "per_block": functools.partial(sort_pairs, ids, E, parallel=True),
            "torch_sort": functools.partial(_torch_sort, ids, bounds),
        }
        entry = rows[f"M={M} E={E}"] = {}
        for name, fn in fns.items():
            try:
                order, starts = fn()
                equal = torch.equal(order, want_order) and torch.equal(starts, want_starts)
                entry[name] = {"equal": bool(equal), "us_in_graph": graph_us(fn, device)}
            except Exception as e:  # noqa: BLE001
                entry[name] = {"error": repr(e)[:300]}
        print(f"sort M={M:5d} E={E:4d}: " + "  ".join(f"{n} {v}" for n, v in entry.items()), flush=True)


def _best(configs: list[dict]) -> dict | None:
    """The fastest configuration whose output matched, or None."""
    timed = [c for c in configs if c.get("close") and "us" in c]
    return min(timed, key=lambda c: c["us"]) if timed else None


def _mla_inputs(B: int, H: int, R: int, P: int, page: int, context: int, k: int, dtype, device: str) -> tuple:
    """One MLA decode case, seeded by B: a latent pool [B * pages * page + page, R + P] (page 0 unused), a page
    table of shuffled pages [B, pages], lens = context, q_lat [B, H, R], q_pe [B, H, P], and a sorted random
    selection of k positions [B, k]."""
    pages = -(-context // page)
    g = torch.Generator(device=device).manual_seed(B)
    pool = torch.randn(B * pages * page + page, R + P, generator=g, device=device).to(dtype)
    table = (torch.randperm(B * pages, generator=g, device=device).view(B, pages) + 1).to(torch.int64)
    lens = torch.full((B,), context, device=device, dtype=torch.int64)
    q_lat = torch.randn(B, H, R, generator=g, device=device).to(dtype)
    q_pe = torch.randn(B, H, P, generator=g, device=device).to(dtype)
    idx = torch.rand(B, context, generator=g, device=device).topk(k, dim=-1).indices.sort(-1).values
    return pool, table, lens, q_lat, q_pe, idx


def mla_decode(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    from kestrel.ops.mla.triton_decode import choose_num_splits, decode_bytes, sparse_mla_decode

    H, R, P, page, context, k = 16, 512, 64, 64, 4096, 2048
    batches = (1, 64, 256)
    knobs = {
        "num_splits": (None, 1, 2, 4, 8),
        "block_n": (32, 64),
        "num_warps": (4, 8),
        "num_stages": (1, 2, 3),
    }
    if smoke:
        H, R, P, page, context, k = 2, 32, 16, 8, 64, 24
        batches = (1, 3)
        knobs = {"num_splits": (None, 2), "block_n": (16,), "num_warps": (4,), "num_stages": (2,)}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    scale = (128 + P) ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
    rows = result["mla_decode"] = {"heads": H, "rank": R, "rope": P, "context": context, "k": k, "sms": sms}
    for B in batches:
        pool, table, lens, q_lat, q_pe, idx = _mla_inputs(B, H, R, P, page, context, k, dtype, device)
        nbytes = decode_bytes(B, context, k, num_heads=H, kv_lora_rank=R, rope_dim=P, page_size=page)
        floor_us = 1e6 * nbytes / (ceilings["copy_TBps"] * 1e12)
        entry = rows[f"B={B}"] = {
            "bytes": nbytes,
            "floor_us": floor_us,
            "default_splits": choose_num_splits(B, H, k, sms),
            "configs": [],
        }
        run = functools.partial(sparse_mla_decode, q_lat, q_pe, pool, table, page, lens, idx, scale)
        want = run().float()
        entry["default"] = {"us": 1000 * time_ms(run, device, warmup_ms=5, rep_ms=25)}
        entry["default"]["floor_share"] = floor_us / entry["default"]["us"]
        for values in itertools.product(*knobs.values()):
            kw = dict(zip(knobs, values))
            fn = functools.partial(run, **kw)
            row = dict(kw)
            try:
                close = torch.allclose(fn().float(), want, rtol=2e-2, atol=2e-2)
                us = 1000 * time_ms(fn, device, warmup_ms=5, rep_ms=25)
                row.update(close=bool(close), us=us, floor_share=floor_us / us)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:200]
            entry["configs"].append(row)
        best = entry["best"] = _best(entry["configs"])
        print(
            f"mla B={B}: floor {floor_us:.1f} us, default {entry['default']['us']:.1f} us, best {best}",
            flush=True,
        )


def mla_layout(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """Where sparse MLA decode's time goes at batch 64 / 256 (mini's sizes): the same kernel over the same
    selected rows reached four ways, each timed with the L2 flushed, and a plain gather of those rows as the
    peer. `sparse` (the decode path): `selected_rows` translates the selection to pool rows, then one load
    before each tile's rows; `sparse_chained` (session 19's path): index -> page table -> row inside the loop,
    two dependent loads before each tile's rows; `rows_page1`: the dense path over a page table of page size 1
    holding the rows themselves, one dependent load; `contiguous`: the dense path over consecutive pages, rows
    streamed in order; `gather_copy`: torch index_select of the same rows (its read bytes over its time). If
    `contiguous` is no faster than `sparse`, the kernel's own loop (tensor-core tiles of 16 heads, online
    softmax) bounds it, not the gather."""
    from kestrel.ops.mla.triton_decode import decode_bytes, sparse_mla_decode

    H, R, P, page, context, k = 16, 512, 64, 64, 4096, 2048
    batches = (64, 256)
    configs = ({}, {"block_n": 64, "num_warps": 8}, {"block_n": 16})
    if smoke:
        H, R, P, page, context, k = 2, 32, 16, 8, 64, 24
        batches, configs = (3,), ({}, {"block_n": 16})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    scale = (128 + P) ** -0.5
    rows_out = result["mla_layout"] = {"heads": H, "rank": R, "rope": P, "context": context, "k": k}
    for B in batches:
        pool, table, lens, q_lat, q_pe, idx = _mla_inputs(B, H, R, P, page, context, k, dtype, device)
        rows = table.gather(1, idx // page) * page + idx % page  # [B, k] the pool rows selected
        k_lens = torch.full((B,), k, device=device, dtype=torch.int64)
        kpages = -(-k // page)
        contiguous = (torch.arange(B * kpages, device=device).view(B, kpages) + 1).to(torch.int64)
        ways = {
            "sparse": (pool, table, page, lens, idx),  # the default: selected_rows first, then the kernel
            "sparse_chained": (pool, table, page, lens, idx, False),
            "rows_page1": (pool, rows, 1, k_lens, None),
            "contiguous": (pool, contiguous, page, k_lens, None),
        }
        nbytes = decode_bytes(B, context, k, num_heads=H, kv_lora_rank=R, rope_dim=P, page_size=page)
        entry = rows_out[f"B={B}"] = {
            "bytes": nbytes,
            "floor_us": 1e6 * nbytes / (ceilings["copy_TBps"] * 1e12),
        }
        want = sparse_mla_decode(q_lat, q_pe, pool, table, page, lens, idx, scale).float()
        for name, (pl, tb, ps, ln, ix, *first) in ways.items():
            for kw in configs:
                label = name + "".join(f" {a}={b}" for a, b in kw.items())
                args = {**kw, "rows_first": first[0]} if first else kw
                fn = functools.partial(sparse_mla_decode, q_lat, q_pe, pl, tb, ps, ln, ix, scale, **args)
                try:
                    got = fn().float()
                    row = {"us": 1000 * time_ms(fn, device, warmup_ms=5, rep_ms=25)}
                    if name != "contiguous":  # other rows: nothing to compare with
                        row["close_to_sparse"] = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
                except Exception as e:  # noqa: BLE001
                    row = {"error": repr(e)[:200]}
                entry[label] = row
        flat = rows.reshape(-1)
        gather = functools.partial(torch.index_select, pool, 0, flat)
        gather_us = 1000 * time_ms(gather, device, warmup_ms=5, rep_ms=25)
        read = flat.numel() * (R + P) * pool.element_size()
        entry["gather_copy"] = {"us": gather_us, "read_TBps": read / (gather_us * 1e-6) / 1e12}
        print(f"mla layout B={B}: " + "  ".join(f"{n} {v}" for n, v in entry.items()), flush=True)


def kda_step(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """The KDA decode step on the state slots (mini: 8 heads of 128 x 128 fp32 state, gate and beta's sigmoid
    in the kernel), fla-core's `fused_recurrent_kda_fwd` against ours (kestrel.ops.kda.triton_recurrent, the
    default since session 20) over a sweep of its block_v and num_warps: each checked against the
    reference (naive.recurrent_inplace, the states too), then timed as the step runs them: 18 layers' calls, each
    with its own state pool, in one CUDA graph; the floor is the state read and written at the copy rate."""
    from kestrel.ops.kda import naive
    from kestrel.ops.kda.triton_recurrent import recurrent_inplace

    H, K, V, layers = 8, 128, 128, 18
    batches = (1, 64, 256)
    grid = {"block_v": (16, 32, 64, 128), "num_warps": (2, 4, 8)}
    if smoke:
        H, K, V, layers, batches = 2, 16, 16, 2, (1, 3)
        grid = {"block_v": (16,), "num_warps": (4,)}
    fns = {"triton": recurrent_inplace}
    if device == "cuda":
        from kestrel.ops.kda import fla

        fns["fla"] = fla.recurrent_inplace
    rows = result["kda_step"] = {"heads": H, "k": K, "v": V, "layers": layers}
    for N in batches:
        g = torch.Generator(device=device).manual_seed(N)
        q, k, f = (torch.randn(N, 1, H, K, generator=g, device=device).bfloat16() for _ in range(3))
        v = torch.randn(N, 1, H, V, generator=g, device=device).bfloat16()
        b = torch.randn(N, 1, H, generator=g, device=device).bfloat16()
        A_log = torch.rand(H, generator=g, device=device)
        dt_bias = torch.randn(H * K, generator=g, device=device)
        gate = (A_log, dt_bias, -5.0)
        pools = [torch.randn(N + 8, H, K, V, generator=g, device=device) * 0.1 for _ in range(layers)]
        slots = (torch.randperm(N + 8, generator=g, device=device)[:N]).to(torch.int32)
        kw = dict(use_qk_l2norm=True, gate=gate, beta_logits=True)
        start = pools[0].clone()  # the timed replays advance pools[0]: each check starts from this copy
        ref_pool = start.clone()
        want = naive.recurrent_inplace(q, k, v, f, b, ref_pool, slots, **kw).float()
        floor_us = 1e6 * N * H * K * V * 4 * 2 / (ceilings["copy_TBps"] * 1e12)
        entry = rows[f"N={N}"] = {"floor_us": floor_us, "configs": []}
        runs = [("fla", {})] if "fla" in fns else []
        runs += [("triton", {})]  # its default tile
        runs += [("triton", dict(zip(grid, c))) for c in itertools.product(*grid.values())]
        for name, tile in runs:
            row = {"kernel": name, **tile}
            try:
                pool = start.clone()
                got = fns[name](q, k, v, f, b, pool, slots, **kw, **tile).float()
                row["close"] = bool(
                    torch.allclose(got, want, rtol=2e-2, atol=2e-2)
                    and torch.allclose(pool, ref_pool, rtol=1e-3, atol=1e-3)
                )
                calls = [functools.partial(fns[name], q, k, v, f, b, p, slots, **kw, **tile) for p in pools]
                row["us"] = calls_us(calls, device)
                row["floor_share"] = floor_us / row["us"]
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:200]
            entry["configs"].append(row)
        entry["best"] = _best(entry["configs"])
        fla_row = next((c for c in entry["configs"] if c["kernel"] == "fla"), None)
        print(f"kda N={N}: floor {floor_us:.1f} us, fla {fla_row}, best {entry['best']}", flush=True)


def _moe_layer_us(device: str, weights_of: list, x, w, ids, **kw) -> float:
    """Microseconds a layer of moe_experts_triton(**kw), one call per layer's weights in one CUDA graph."""
    from kestrel.ops.moe.triton_experts import moe_experts_triton

    calls = [
        functools.partial(moe_experts_triton, x, a, b, w, ids, "silu", shared=shared, **kw)
        for a, b, shared in weights_of
    ]
    return calls_us(calls, device)


def moe_tiles(result: dict, device: str, smoke: bool, ceilings: dict, tokens: tuple = (1, 64, 256)) -> None:
    """The routed experts' Triton launch knobs (moe_experts_triton's block_m, block_n, block_k, num_stages; 4
    warps) at mini's sizes (64 experts of 2048 x 256, top-6, and the shared expert of the same width in the
    same launches, as the MoE layer runs them), `tokens` (--moe-tokens; 1, 64 and 256). Two sweeps, each against
    the defaults: gate_up's knobs (down at its default tiles; block_m, the pairs a block, is both kernels'), then
    down's (gate_up at its default). Each configuration's output is checked against the default's and timed per
    layer in a CUDA graph of 8 layers' weights (no L2 reuse between calls, as in a step) against the bytes of the
    experts hit (the shared one included) at the copy rate. The batch-256 step spent 1.76 ms in 24 layers' experts
    (73 us a layer; session 21) against 48 us of bytes."""
    from kestrel.ops.moe.triton_experts import _tiles, moe_experts_triton

    E, A, D, I, layers = 64, 6, 2048, 256, 8
    gate_up_grid = {
        "block_m": (16, 32, 64),
        # 16 added in session 42, not yet run: at 256 tokens 64 gives ~480 programs, ~1.2 waves if 3 fit an SM
        "block_n": (16, 32, 64),
        "block_k": (64, 128, 256),
        "stages": (3, 4, 5),
    }
    down_grid = {"block_n": (32, 64, 128, 256), "block_k": (64, 128, 256), "stages": (2, 3, 4)}
    if smoke:
        E, A, D, I, layers, tokens = 8, 2, 64, 32, 2, (1, 5)
        gate_up_grid = {"block_m": (16,), "block_n": (32,), "block_k": (32, 64), "stages": (2,)}
        down_grid = {"block_n": (32,), "block_k": (32,), "stages": (2, 3)}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def weights(*lead):
        return (
            (torch.randn(*lead, 2 * I, D, generator=g, device=device) * 0.02).to(dtype),
            (torch.randn(*lead, D, I, generator=g, device=device) * 0.02).to(dtype),
        )

    weights_of = [(*weights(E), weights()) for _ in range(layers)]  # (w13, w2, (ws13, ws2)) a layer
    rows = result["moe_tiles"] = {"experts": E, "top_k": A, "hidden": D, "inter": I, "shared_expert": True}
    for T in tokens:
        x = torch.randn(T, D, generator=g, device=device).to(dtype)
        ids = torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :A]  # [T, A] distinct per token
        w = torch.rand(T, A, generator=g, device=device)
        hit = int(ids.unique().numel()) + 1  # and the shared expert
        floor_us = 1e6 * hit * 3 * D * I * 2 / (ceilings["copy_TBps"] * 1e12)
        w13, w2, shared = weights_of[0]
        want = moe_experts_triton(x, w13, w2, w, ids, "silu", shared=shared).float()

        per_layer_us = functools.partial(_moe_layer_us, device, weights_of, x, w, ids)
        bm, bn, bk = _tiles(T * A, E)
        entry = rows[f"T={T}"] = {
            "experts_hit": hit,
            "floor_us": floor_us,
            "default": {"block_m": bm, "block_n": bn, "block_k": bk, "us": per_layer_us()},
        }

        gate_up = [(dict(zip(gate_up_grid, v)), "gate_up") for v in itertools.product(*gate_up_grid.values())]
        down = [(dict(zip(down_grid, v)), "down") for v in itertools.product(*down_grid.values())]
        entry["gate_up"], entry["down"] = [], []
        for row, part in gate_up + down:
            if part == "gate_up":  # down at its default tiles (block_m is both kernels')
                kw = {"block_m": row["block_m"], "block_n": (row["block_n"], bn[1])}
                kw |= {"block_k": (row["block_k"], bk[1]), "num_stages": (row["stages"], 3)}
            else:  # gate_up at its default
                kw = {"block_n": (bn[0], row["block_n"]), "block_k": (bk[0], row["block_k"])}
                kw |= {"num_stages": (3, row["stages"])}
            try:
                got = moe_experts_triton(x, w13, w2, w, ids, "silu", shared=shared, **kw).float()
                row["close"] = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
                row["us"] = per_layer_us(**kw)
                row["floor_share"] = floor_us / row["us"]
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:200]
            entry[part].append(row)
        entry["best_gate_up"], entry["best_down"] = _best(entry["gate_up"]), _best(entry["down"])
        print(
            f"moe T={T}: floor {floor_us:.1f} us, default {entry['default']['us']:.1f} us, "
            f"best gate_up {entry['best_gate_up']}, best down {entry['best_down']}",
            flush=True,
        )


@functools.cache
def _stream_kernel():
    """A Triton kernel that only reads expert weights the way the experts' kernels do (built on first use, so
    importing this script needs no Triton): program (e, n) of expert e streams its rows n * BN .. n * BN + BN - 1
    over K in BK steps (PAIRED: also the rows `pair` further on, as gate_up reads gate and up) and stores one sum a
    row, so that no load is dead."""
    import triton
    import triton.language as tl

    @triton.jit
    def stream(w, out, rows_per_e, pair, K, BN: tl.constexpr, BK: tl.constexpr, PAIRED: tl.constexpr):
        e, n = tl.program_id(0), tl.program_id(1)
        rows = n * BN + tl.arange(0, BN)
        base = w + e.to(tl.int64) * rows_per_e * K + rows[:, None].to(tl.int64) * K
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            acc += tl.load(base + ks[None, :], mask=(ks < K)[None, :], other=0.0).to(tl.float32)
            if PAIRED:
                acc += tl.load(base + pair * K + ks[None, :], mask=(ks < K)[None, :], other=0.0).to(
                    tl.float32
                )
        tl.store(out + (e * tl.num_programs(1) + n) * BN + tl.arange(0, BN), tl.sum(acc, axis=1))

    return stream


def moe_anatomy(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """Why the routed experts run at ~60% of their bytes at batch 256 while their tiles do not matter
    (`moe_tiles`): the same weights read with no math at all, in the kernels' own tile order and grid, over 8
    layers' weights in one CUDA graph, against the copy rate: gate_up's pattern (expert e's gate and up rows,
    [BN, BK] tiles a step over Din) and down's ([BN, BK] over I), at the default tiles and at wider / narrower
    ones. If reading alone stays near 60%, the pattern or the grid is what to change; if it reaches the copy
    rate, the experts' kernels lose the time elsewhere (their pipelining, the dots, the routing's blocks).
    Also the whole call (`moe_experts_triton`, shared expert in) at batch 256 under the random routing and under
    a balanced one (24 pairs every expert: one block each)."""
    from kestrel.ops.moe.triton_experts import moe_experts_triton

    E, A, D, I, T, layers = 64, 6, 2048, 256, 256, 8
    patterns = {
        "gate_up": [(64, 64), (32, 256), (128, 64), (64, 256)],
        "down": [(64, 64), (128, 64), (256, 256)],
    }
    if smoke:
        E, A, D, I, T, layers = 4, 2, 64, 32, 8, 2
        patterns = {"gate_up": [(16, 32)], "down": [(16, 16)]}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    w13s = [(torch.randn(E, 2 * I, D, generator=g, device=device) * 0.02).to(dtype) for _ in range(layers)]
    w2s = [(torch.randn(E, D, I, generator=g, device=device) * 0.02).to(dtype) for _ in range(layers)]
    rows = result["moe_anatomy"] = {"experts": E, "hidden": D, "inter": I, "tokens": T}
    stream = _stream_kernel()
    for part, tiles in patterns.items():
        weights, rows_per_e, K, n_rows = (w13s, 2 * I, D, I) if part == "gate_up" else (w2s, D, I, D)
        nbytes = weights[0].numel() * weights[0].element_size()
        floor_us = 1e6 * nbytes / (ceilings["copy_TBps"] * 1e12)
        entry = rows[part] = {"bytes": nbytes, "floor_us": floor_us, "tiles": []}
        for bn, bk in tiles:
            grid = (E, -(-n_rows // bn))
            out = torch.empty(E * grid[1] * bn, device=device, dtype=torch.float32)
            calls = [
                functools.partial(
                    stream[grid],
                    w,
                    out,
                    rows_per_e,
                    I,
                    K,
                    BN=bn,
                    BK=bk,
                    PAIRED=part == "gate_up",
                    num_warps=4,
                )
                for w in weights
            ]
            calls[0]()
            want = weights[0].float().view(E, rows_per_e, K)
            want = want[:, :I] + want[:, I:] if part == "gate_up" else want
            close = bool(torch.allclose(out.view(E, -1), want.sum(-1), rtol=1e-3, atol=1e-2))
            us = calls_us(calls, device)
            entry["tiles"].append(
                {"block_n": bn, "block_k": bk, "close": close, "us": us, "floor_share": floor_us / us}
            )
        print(f"moe anatomy {part}: floor {floor_us:.1f} us, reading alone {entry['tiles']}", flush=True)

    x = torch.randn(T, D, generator=g, device=device).to(dtype)
    w = torch.rand(T, A, generator=g, device=device)
    shareds = [(w13[0].clone(), w2[0].clone()) for w13, w2 in zip(w13s, w2s)]  # one more expert a layer
    rows["whole_call_floor_us"] = 1e6 * (E + 1) * 3 * D * I * 2 / (ceilings["copy_TBps"] * 1e12)
    routings = {
        "random": torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :A],
        "balanced": (torch.arange(T * A, device=device) % E).view(T, A),  # T * A / E pairs every expert
    }
    for name, ids in routings.items():
        fns = [
            functools.partial(moe_experts_triton, x, a, b, w, ids, "silu", shared=s)
            for a, b, s in zip(w13s, w2s, shareds)
        ]
        us = calls_us(fns, device)
        rows[f"whole_call_{name}_us"] = us
    print(f"moe anatomy whole call: {rows}", flush=True)


def small_kernels(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """The decode step's small kernels at mini's sizes, each in a CUDA graph of its step's calls, against its
    bytes at the copy rate and against the launch floor (a one-element fill in the same graph): the AttnRes mix
    (48 a step, S sources), the KDA conv step (18), and the program-per-block pair sort's knobs (24)."""
    import triton

    from kestrel.ops.attnres.triton_mix import _mix, attnres_mix_norm_triton
    from kestrel.ops.kda.triton_conv import conv_step_inplace
    from kestrel.ops.moe.router_gemm import mm_fp32_out_works, router_logit_parts_bf16x3, split_bf16x3
    from kestrel.ops.moe.triton_experts import _combine, _sort_pairs_blocks_kernel
    from kestrel.ops.moe.triton_router import route_hidden_triton, route_triton

    D, C, W, E = (64, 48, 4, 8) if smoke else (2048, 3072, 4, 64)
    batches = (1, 4) if smoke else (1, 64, 256)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(2)
    copy = ceilings["copy_TBps"] * 1e12
    one = torch.zeros(1, device=device)
    rows = result["small_kernels"] = {"launch_floor_us": graph_us(one.zero_, device, 48)}
    for T in batches:
        for S in (2, 5):
            src = torch.randn(S, T, D, generator=g, device=device).to(dtype)
            q, w, ow = (torch.randn(D, generator=g, device=device).to(dtype) for _ in range(3))
            fn = functools.partial(attnres_mix_norm_triton, src, q, w, 1e-5, ow, 1e-5)
            nbytes = (S + 1) * T * D * 2
            rows[f"mix T={T} S={S}"] = {"us": graph_us(fn, device, 48), "bytes_us": 1e6 * nbytes / copy}
            for warps in (4, 8, 16):
                fn = functools.partial(_mix, src, q, w, 1e-5, ow, 1e-5, num_warps=warps)
                rows[f"mix T={T} S={S}"][f"us_{warps}_warps"] = graph_us(fn, device, 48)
        pool = torch.randn(T + 1, C, W - 1, generator=g, device=device).to(dtype)
        x = torch.randn(T, C, generator=g, device=device).to(dtype)
        cw = torch.randn(C, W, generator=g, device=device).to(dtype)
        slots = torch.arange(1, T + 1, device=device)
        fn = functools.partial(conv_step_inplace, x, cw, pool, slots, planes=3)
        nbytes = (2 * T * C + 2 * T * C * (W - 1)) * 2
        rows[f"conv_step T={T}"] = {"us": graph_us(fn, device, 18), "bytes_us": 1e6 * nbytes / copy}
        M = T * 6
        ids = torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :6].reshape(-1)
        order = torch.empty(M, dtype=torch.int64, device=device)
        starts = torch.empty(E + 1, dtype=torch.int32, device=device)
        want = torch.sort(ids, stable=True)[1]
        ep, mp = triton.next_power_of_2(E), triton.next_power_of_2(M)
        knobs = rows[f"sort M={M}"] = []
        for block, warps in sorted(
            {(min(b, mp), w) for b, w in itertools.product((32, 64, 128), (4, 8, 16))}
        ):
            sort = functools.partial(
                _sort_pairs_blocks_kernel[(triton.cdiv(M, block),)],
                ids, order, starts, M, E, EP=ep, MP=mp, BLOCK=block, num_warps=warps,
            )  # fmt: skip
            sort()
            knobs.append(
                {
                    "block": block,
                    "warps": warps,
                    "equal": bool(torch.equal(order, want)),
                    "us": graph_us(sort, device),
                }
            )
    # the experts' combine (24 a step): its column block, with the shared expert's rows and the residual add
    for T in batches:
        A = 6
        y = torch.randn(T * A + T, D, generator=g, device=device).to(dtype)
        ids = torch.rand(T, E, generator=g, device=device).argsort(-1)[:, :A]
        cw = torch.rand(T, A, generator=g, device=device)
        out = torch.randn(T, D, generator=g, device=device).to(dtype)
        nbytes = (T * A + 3 * T) * D * 2
        entry = rows[f"combine T={T}"] = {"bytes_us": 1e6 * nbytes / copy}
        for block in (128, 256, 512, 1024):
            fn = functools.partial(
                _combine, y, ids, ids, cw, out, E, False, shared=True, accumulate=True, block_n=block
            )
            entry[f"us_block_{block}"] = graph_us(fn, device)
    # the router from the hidden states: programs (slices of D) against the router GEMM path, 24 calls a graph
    rw = torch.randn(E, D, generator=g, device=device) * D**-0.5
    bias = torch.randn(E, generator=g, device=device) * 0.1
    split = split_bf16x3(rw) if mm_fp32_out_works(rw.device) else None
    from kestrel.ops.moe import route

    for T in (1, 4) if smoke else (1, 16, 64, 128):
        x = torch.randn(T, D, generator=g, device=device).to(dtype)
        entry = rows[f"router T={T}"] = {}
        want = route(x.float() @ rw.t(), bias, 6, True, 2.5)[1]  # the reference's experts
        # the slice width follows `programs` at batch 1 only (from 2 tokens on it is 128): one setting past that
        for programs in (16, 32, 64, 128, 256) if T == 1 else (32,):
            fn = functools.partial(route_hidden_triton, x, rw, bias, 6, True, 2.5, programs=programs)
            entry[f"us_{programs}_programs"] = graph_us(fn, device)
            entry[f"same_experts_{programs}_programs"] = bool(torch.equal(fn()[1], want))
        if split is not None:

            def gemm_then_route(x=x):
                return route_triton(router_logit_parts_bf16x3(x, split), bias, 6, True, 2.5)

            entry["us_gemm_then_route"] = graph_us(gemm_then_route, device)
    # the DSA top-k at decode's short rows (6 calls a step): the CUDA kernel's variants, Triton's, torch.topk
    from kestrel.ops.dsa.triton_topk import topk_triton

    L, k = (300, 64) if smoke else (4160, 2048)
    for B in batches:
        scores = torch.randn(B, L, generator=g, device=device)
        lens = torch.full((B,), L - 64, device=device, dtype=torch.int64)
        fns = {"triton": functools.partial(topk_triton, scores, lens, k)}
        if device == "cuda":
            from kestrel.ops.dsa import cuda_topk

            if cuda_topk.available():
                fns |= {
                    f"cuda_variant_{v}": functools.partial(cuda_topk.topk_cuda, scores, lens, k, variant=v)
                    for v in (0, 3)
                }
        want = fns["triton"]()
        entry = rows[f"topk B={B} L={L - 64}"] = {
            "torch_topk_us": graph_us(
                functools.partial(torch.topk, scores[:, : L - 64], k, dim=-1), device, 6
            )
        }
        for name, fn in fns.items():
            try:
                entry[name] = {"equal": bool(torch.equal(fn(), want)), "us": graph_us(fn, device, 6)}
            except Exception as e:  # noqa: BLE001
                entry[name] = {"error": repr(e)[:200]}
    print(f"small kernels: {rows}", flush=True)


def pdl(result: dict, device: str, smoke: bool) -> None:
    """Programmatic dependent launch (kestrel.ops.pdl) on a chain of dependent decode kernels: RMSNorm then the
    sigmoid gate, 100 times, each reading the one before, at mini's width and batch 1 / 64 / 256, in one CUDA
    graph with KESTREL_PDL=off and auto; the two chains' outputs compared bit for bit."""
    from kestrel.bench.roofline import dependent_chain

    D, links, batches = (64, 4, (1, 3)) if smoke else (2048, 100, (1, 64, 256))
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = torch.rand(D, generator=g, device=device).to(dtype) + 0.5
    rows = result["pdl"] = {"hidden": D, "kernels": 2 * links, "batches": {}}
    for B in batches:
        x = torch.randn(B, D, generator=g, device=device).to(dtype)
        gate = torch.randn(B, D, generator=g, device=device).to(dtype)
        outs = {}

        def chain(x=x, gate=gate, outs=outs, key="off"):
            outs[key] = dependent_chain(x, w, gate, links)

        entry = rows["batches"][B] = {}
        for mode in ("off", "auto"):
            with env_overrides({"KESTREL_PDL": mode}):
                us = calls_us([functools.partial(chain, key=mode)], device)
            entry[f"{mode}_us_per_kernel"] = us / rows["kernels"]
        entry["same_bits"] = bool(torch.equal(outs["off"], outs["auto"]))
        print(f"pdl B={B}: {entry}", flush=True)


def argmax(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """The greedy rows' argmax over mini's vocabulary (129,280) at batch 1 / 64 / 256, on the bf16 logits the
    decode graphs end with (and fp32): torch.argmax against the two Triton kernels
    (kestrel.ops.sampling.triton_argmax) at each chunk width, one call a graph replay, the logits' bytes at the
    copy rate beside them; the same indices."""
    from kestrel.ops.sampling.triton_argmax import argmax_triton

    V, batches, blocks = (
        (5000, (1, 3), (1024, 2048)) if smoke else (129280, (1, 64, 256), (1024, 2048, 4096, 8192))
    )
    g = torch.Generator(device=device).manual_seed(0)
    rows = result["argmax"] = {"vocab": V, "batches": {}}
    for B in batches:
        for dtype in (torch.bfloat16, torch.float32) if device == "cuda" else (torch.float32,):
            x = torch.randn(B, V, generator=g, device=device).to(dtype)
            want = torch.argmax(x, -1)
            entry = rows["batches"][f"{B} {str(dtype)[6:]}"] = {
                "floor_us": 1e6 * x.numel() * x.element_size() / (ceilings["copy_TBps"] * 1e12),
                "torch_us": calls_us([functools.partial(torch.argmax, x, -1)], device),
                "triton_us": {
                    block: calls_us([functools.partial(argmax_triton, x, block)], device) for block in blocks
                },
                "same": all(torch.equal(argmax_triton(x, block), want) for block in blocks),
            }
            print(f"argmax B={B} {dtype}: {entry}", flush=True)


def sampling(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """The sampler's per-step work beside the decode graph, mini's vocabulary (129,280), bf16 logits, batch 1 / 64
    / 256, one call a graph replay: the top-5 logprobs and sampled tokens' by torch (log_softmax of an fp32 copy,
    topk, gather: `naive.token_logprobs`) against the two Triton kernels (`token_logprobs_triton`); frequency and
    presence penalties over [B, V] (`naive.apply_penalties`, a dense seen mask) against the seen tokens only
    (`naive.apply_penalties_at`), 4,096 prompt tokens and 40 outputs a row; the logits' bytes at the copy rate
    beside them. The values are compared (logprobs: largest difference; penalties: bit for bit)."""
    from kestrel.ops.sampling import naive
    from kestrel.ops.sampling.triton_logprobs import token_logprobs_triton

    V, batches, prompt, outputs = (5000, (1, 3), 64, 4) if smoke else (129280, (1, 64, 256), 4096, 40)
    g = torch.Generator(device=device).manual_seed(0)
    res = result["sampling"] = {"vocab": V, "k": 5, "prompt": prompt, "outputs": outputs, "batches": {}}
    for B in batches:
        x = (torch.randn(B, V, generator=g, device=device) * 3).to(torch.bfloat16)
        tokens = torch.randint(0, V, (B,), generator=g, device=device)
        ref = naive.token_logprobs(x, tokens, 5)
        got = token_logprobs_triton(x, tokens, 5)
        ids = torch.randint(0, V, (B, prompt + outputs), generator=g, device=device)
        rows = torch.arange(B, device=device)[:, None].expand_as(ids).reshape(-1)
        counts = torch.zeros(B, V, device=device)
        # the outputs: every row's last ids
        out_rows = torch.arange(B, device=device).repeat_interleave(outputs)
        counts.index_put_(
            (out_rows, ids[:, prompt:].reshape(-1)), torch.ones(B * outputs, device=device), accumulate=True
        )
        seen = torch.zeros(B, V, dtype=torch.bool, device=device)
        seen[rows, ids.reshape(-1)] = True
        # repetition, frequency, presence
        params = [torch.full((B,), v, device=device) for v in (1.3, 0.5, 0.3)]
        dense = functools.partial(naive.apply_penalties, x, counts, seen, *params)
        at = functools.partial(naive.apply_penalties_at, x, counts, rows, ids.reshape(-1), *params)
        entry = res["batches"][B] = {
            "floor_us": 1e6 * x.numel() * x.element_size() / (ceilings["copy_TBps"] * 1e12),
            "logprobs_torch_us": calls_us([functools.partial(naive.token_logprobs, x, tokens, 5)], device),
            "logprobs_triton_us": calls_us([functools.partial(token_logprobs_triton, x, tokens, 5)], device),
            "logprobs_k20_torch_us": calls_us(
                [functools.partial(naive.token_logprobs, x, tokens, 20)], device
            ),
            "logprobs_k20_triton_us": calls_us(
                [functools.partial(token_logprobs_triton, x, tokens, 20)], device
            ),
            "logprobs_triton_us_by_block": {
                block: calls_us([functools.partial(token_logprobs_triton, x, tokens, 5, block=block)], device)
                for block in ((1024, 2048) if smoke else (2048, 4096, 8192))
            },
            "logprobs_max_diff": max(
                (a.float() - b.float()).abs().max().item() for a, b in zip(ref[:2], got[:2])
            ),
            "logprobs_same_ids": bool(torch.equal(x.gather(1, ref[2]), x.gather(1, got[2]))),
            "penalties_dense_us": calls_us([dense], device),
            "penalties_at_seen_us": calls_us([at], device),
            "penalties_same": bool(torch.equal(dense().view(torch.int32), at().view(torch.int32))),
        }
        print(f"sampling B={B}: {entry}", flush=True)


def _norm_then_linear(x, norm_w, w):
    from kestrel.ops.linear import linear
    from kestrel.ops.norm.triton_norm import rms_norm_triton

    return linear(rms_norm_triton(x, norm_w, 1e-6), w)


def gemv(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """The linear layers at decode sizes (kestrel.ops.linear): cuBLAS (KESTREL_GEMV=off) against the Triton GEMV
    (PDL, weights asked into L2 before the wait), each projection after an RMSNorm of its input as in a layer,
    mini's shapes (N x K: 3072 x 2048 MLA q, 576 x 2048 kv_a, 2048 x 1024 KDA o, 4096 x 2048 KDA q|k|v|f), a
    layer's weights apiece in one CUDA graph of 24 layers; us a projection against its weight bytes at the copy
    rate, batch 1 / 4 / 16; outputs compared with cuBLAS's."""
    shapes, layers, batches = (
        ([(48, 32), (16, 64)], 2, (1, 3))
        if smoke
        else ([(3072, 2048), (576, 2048), (2048, 1024), (4096, 2048)], 24, (1, 4, 16))
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    rows = result["gemv"] = {}
    for N, K in shapes:
        ws = [(torch.randn(N, K, generator=g, device=device) * 0.02).to(dtype) for _ in range(layers)]
        norm_w = torch.ones(K, device=device, dtype=dtype)
        floor_us = 1e6 * N * K * ws[0].element_size() / (ceilings["copy_TBps"] * 1e12)
        for B in batches:
            x = torch.randn(B, K, generator=g, device=device).to(dtype)
            entry = rows[f"{N}x{K} B={B}"] = {"floor_us": floor_us}
            outs = {}
            calls = [functools.partial(_norm_then_linear, x, norm_w, w) for w in ws]
            for mode in ("off", "auto"):
                with env_overrides({"KESTREL_GEMV": mode}):
                    outs[mode] = calls[0]().float()
                    entry[f"{mode}_us"] = calls_us(calls, device)
            entry["close"] = bool(torch.allclose(outs["auto"], outs["off"], rtol=2e-2, atol=2e-2))
            print(f"gemv {N}x{K} B={B}: {entry}", flush=True)
    gemv_merged(result, device, smoke, ceilings, layers, batches)


def gemv_merged(result: dict, device: str, smoke: bool, ceilings: dict, layers: int, batches: tuple) -> None:
    """MLA's projections of one input (mini: q 3072, kv_a 576, the output gate 2048, the indexer's q 2048, k 128
    and weights 16, all of 2048 inputs) after an RMSNorm: a GEMV launch apiece against one launch of all six
    (`gemv_many_triton`, as the layer runs them at decode), a layer's weights apiece in one CUDA graph; us a
    layer against the weights' bytes at the copy rate; whether the two give the same bits."""
    from kestrel.ops.linear.triton_gemv import gemv_many_triton, gemv_triton
    from kestrel.ops.norm.triton_norm import rms_norm_triton

    Ns, K = ((48, 16, 32, 8), 64) if smoke else ((3072, 576, 2048, 2048, 128, 16), 2048)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    sets = [
        [(torch.randn(n, K, generator=g, device=device) * 0.02).to(dtype) for n in Ns] for _ in range(layers)
    ]
    norm_w = torch.ones(K, device=device, dtype=dtype)
    rows = result["gemv_merged"] = {"shapes": [[n, K] for n in Ns]}

    def apart(x, ws):
        h = rms_norm_triton(x, norm_w, 1e-6)
        return [gemv_triton(h, w) for w in ws]

    def merged(x, ws):
        return gemv_many_triton(rms_norm_triton(x, norm_w, 1e-6), ws)

    for B in batches:
        x = torch.randn(B, K, generator=g, device=device).to(dtype)
        entry = rows[f"B={B}"] = {
            "floor_us": 1e6 * sum(Ns) * K * sets[0][0].element_size() / (ceilings["copy_TBps"] * 1e12)
        }
        entry["apart_us"] = calls_us([functools.partial(apart, x, ws) for ws in sets], device)
        entry["one_launch_us"] = calls_us([functools.partial(merged, x, ws) for ws in sets], device)
        entry["same"] = all(torch.equal(a, b) for a, b in zip(apart(x, sets[0]), merged(x, sets[0])))
        print(f"gemv merged B={B}: {entry}", flush=True)


def _gemv_chain(layers: list, x: torch.Tensor, **knobs) -> torch.Tensor:
    """x through each layer's (W_in, W_o): y = x W_in^T, then y's first W_o.shape[1] columns through W_o (a KDA
    layer's in-projection and o-projection at decode); knobs for gemv_triton."""
    from kestrel.ops.linear.triton_gemv import gemv_triton

    h = x
    for w_in, w_o in layers:
        h = gemv_triton(h, w_in, **knobs)  # the in-projection takes all of h
        h = gemv_triton(h[:, : w_o.shape[1]], w_o, **knobs)
    return h


def gemv_rows(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """The rows kernel (triton_gemv._gemv_rows_kernel: a program's whole slice of W in one load, issued before
    the PDL wait with `early`; the default up to ROWS_AUTO_M rows) against the K-loop kernel (kernel="dot") on
    batch 1-4's projections, us a layer against the weights' bytes at the copy rate, in one CUDA graph each:
    - chain: l2_ahead's chain of mini's KDA projections (4232 x 2048 in, 2048 x 1024 out), 24 layers' weights
      (cold: 24 x 21 MB do not stay in L2), and the best rows configuration on one layer's weights (hot);
    - merged: MLA's six projections of one input (`gemv_merged`'s shapes) in one launch, after an RMSNorm, 24
      layers' weights.
    Batch 1 sweeps the rows kernel's tile (rows of W a program), warps and `early`, then the best on grids of 1,
    2 and 4 programs an SM walking the slices (`rows_programs`); batches 2 and 4 take its three best. Each batch
    also runs the default tile (`rows_tile`, no knobs: rows_block_n absent from its row). Each output
    is compared with torch's (relative error)."""
    from kestrel.ops.linear.triton_gemv import gemv_many_triton
    from kestrel.ops.norm.triton_norm import rms_norm_triton

    (N_in, K_in), (N_o, K_o), layers = ((48, 32), (32, 16), 3) if smoke else ((4232, 2048), (2048, 1024), 24)
    Ns, K_m = ((48, 16, 32, 8), 64) if smoke else ((3072, 576, 2048, 2048, 128, 16), 2048)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    cold = [(r(N_in, K_in), r(N_o, K_o, scale=0.05)) for _ in range(layers)]
    sets = [[r(n, K_m) for n in Ns] for _ in range(layers)]
    norm_w = torch.ones(K_m, device=device, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    entry = result["gemv_rows"] = {
        "layers": layers,
        "chain_shapes": [[N_in, K_in], [N_o, K_o]],
        "merged_shapes": [[n, K_m] for n in Ns],
        "chain_floor_us_a_layer": 1e6 * (N_in * K_in + N_o * K_o) * size / (ceilings["copy_TBps"] * 1e12),
        "merged_floor_us_a_layer": 1e6 * sum(Ns) * K_m * size / (ceilings["copy_TBps"] * 1e12),
        "runs": [],
    }

    def torch_chain(x):
        h = x.float()
        for w_in, w_o in cold:
            h = (h.to(dtype) @ w_in.T).float()
            h = (h[:, : w_o.shape[1]].to(dtype) @ w_o.T).float()
        return h

    def merged(x, ws, **knobs):
        return gemv_many_triton(rms_norm_triton(x, norm_w, 1e-6), ws, **knobs)

    def run(B: int, knobs: dict, hot: bool = False) -> dict:
        row = {"batch": B, **knobs}
        try:
            x = torch.randn(B, K_in, generator=g, device=device).to(dtype)
            want = torch_chain(x)
            got = _gemv_chain(cold, x, **knobs).float()
            row["chain_rel_err"] = ((got - want).norm() / want.norm()).item()
            row["chain_us_a_layer"] = (
                calls_us([functools.partial(_gemv_chain, cold, x, **knobs)], device) / layers
            )
            if hot:
                hot_layers = [cold[0]] * layers
                call = functools.partial(_gemv_chain, hot_layers, x, **knobs)
                row["chain_hot_us_a_layer"] = calls_us([call], device) / layers
            xm = torch.randn(B, K_m, generator=g, device=device).to(dtype)
            h = torch.nn.functional.rms_norm(xm.float(), (K_m,), norm_w.float(), 1e-6).to(dtype)
            errs = [
                ((o.float() - (h @ w.T).float()).norm() / (h @ w.T).float().norm()).item()
                for o, w in zip(merged(xm, sets[0], **knobs), sets[0])
            ]
            row["merged_rel_err"] = max(errs)
            row["merged_us_a_layer"] = calls_us(
                [functools.partial(merged, xm, ws, **knobs) for ws in sets], device
            )
        except Exception as e:  # noqa: BLE001 (a configuration the GPU cannot hold: recorded, the sweep goes on)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"gemv_rows {row}", flush=True)
        entry["runs"].append(row)
        return row

    sweep = [dict(kernel="dot")]
    tiles, warps = ((1, 4), (2,)) if smoke else ((2, 4, 8, 16), (4, 8))
    sweep += [
        dict(kernel="rows", rows_block_n=bn, rows_warps=w, early=early)
        for bn in tiles
        for w in warps
        for early in (True, False)
    ]
    first = [run(1, knobs) for knobs in sweep]
    ranked = sorted(
        (r for r in first if r.get("kernel") == "rows" and "error" not in r),
        key=lambda r: r["chain_us_a_layer"] + r["merged_us_a_layer"],
    )
    keys = ("kernel", "rows_block_n", "rows_warps", "early")
    best = [{k: r[k] for k in keys} for r in ranked[:3]]
    entry["best_batch_1"] = best[:1]
    if best:
        run(1, best[0], hot=True)
        # the best tile on grids smaller than its slices: each program walks several, the next one's loads out
        # before this one's sums (rows_programs)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 2
        for per_sm in (1, 2, 4):
            run(1, best[0] | dict(rows_programs=per_sm * sms))
    run(1, dict(kernel="dot"), hot=True)
    run(1, dict(kernel="rows"))  # the default tile (`rows_tile`)
    for B in (2, 4):
        for knobs in [dict(kernel="dot"), dict(kernel="rows"), *best]:
            run(B, knobs)


def l2_ahead(result: dict, device: str, smoke: bool, ceilings: dict) -> None:
    """What batch 1's projections would gain from weights already in L2: mini's KDA layer projections (the
    in-projection q|k|v|f_a|b|g 4232 x 2048, then the o-projection 2048 x 1024 of its first 1024 columns), 24
    layers chained in one CUDA graph, us a layer against the weights' bytes at the copy rate:
    - cold: each layer its own weights, as the step reads them (each GEMV asks its own slice into L2 before its
      PDL wait: the lead of one kernel it has);
    - hot: one layer's weights for all 24 (21 MB: they stay in L2), the ceiling of any prefetching.
    Session 52 on the H200: floor 5.04, cold 11.15, hot 10.08 us: hot is barely below cold, so the GEMVs are
    bound by their launches and latency, not by where their weights come from. A side stream asking the weights
    of the GEMV 1 to 6 places ahead made each layer slower (14.3-14.5 us), and the decode step it was put into
    (KESTREL_L2_AHEAD, sessions 49-52) 1-4% slower: both were removed.
    - persistent: the 48 GEMVs as one launch whose programs ask L2 for the stages ahead themselves and wait on a
      counter a stage (`_persistent_chain`, session 53): what a batch-1 megakernel would make of the projections."""
    (N_in, K_in), (N_o, K_o), layers = ((48, 32), (32, 16), 3) if smoke else ((4232, 2048), (2048, 1024), 24)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def weights():
        return (
            (torch.randn(N_in, K_in, generator=g, device=device) * 0.02).to(dtype),
            (torch.randn(N_o, K_o, generator=g, device=device) * 0.05).to(dtype),
        )

    cold = [weights() for _ in range(layers)]
    hot = [cold[0]] * layers
    x = torch.randn(1, K_in, generator=g, device=device).to(dtype)
    bytes_layer = (N_in * K_in + N_o * K_o) * cold[0][0].element_size()
    entry = result["l2_ahead"] = {
        "layers": layers,
        "shapes": [[N_in, K_in], [N_o, K_o]],
        "floor_us_a_layer": 1e6 * bytes_layer / (ceilings["copy_TBps"] * 1e12),
    }
    for key, chain_layers in (("cold", cold), ("hot", hot)):
        call = functools.partial(_gemv_chain, chain_layers, x)
        entry[f"{key}_us_a_layer"] = calls_us([call], device) / layers
    print(f"l2_ahead: {entry}", flush=True)
    entry["persistent"] = _persistent_chain([w for pair in cold for w in pair], x, layers, device)
    best = min((r for r in entry["persistent"] if r.get("ok")), key=lambda r: r["us_a_layer"], default=None)
    entry["persistent_best"] = best
    print(f"l2_ahead persistent best: {best}", flush=True)
    # the same stages on 64 x 64 weights (8 KB each): what the counters cost a layer with next to no bytes
    n = min(64, K_in)
    tiny = [(torch.randn(n, n, generator=g, device=device) * 0.1).to(dtype) for _ in range(2 * layers)]
    grids = [dict(block_n=16, ahead=0)]
    if device == "cuda":  # the counters' cost as the programs that arrive at each grow
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        grids = [dict(block_n=16, ahead=0, programs=p * sms) for p in (1, 2, 4, 8)]
    entry["barriers_only"] = _persistent_chain(tiny, x[:, :n], layers, device, grids)
    print(f"l2_ahead barriers only: {entry['barriers_only']}", flush=True)
    if (
        device == "cuda" and dtype == torch.bfloat16
    ):  # the CUDA chain (cuda_chain.cu): the weights ahead in flight
        entry["cuda_chain"] = _cuda_chain([w for pair in cold for w in pair], x, layers)
        variants = [
            dict(pipe=True, ll=True),
            dict(pipe=True, ll=True, own_pages=True),
            dict(pipe=True, ll=True, mma=True),
        ]
        entry["cuda_chain_barriers_only"] = _cuda_chain(tiny, x[:, :n], layers, variants)
        print(f"l2_ahead cuda chain barriers only: {entry['cuda_chain_barriers_only']}", flush=True)


def _cuda_chain(weights: list, x: torch.Tensor, layers: int, configs=None) -> list[dict]:
    """The chain as one persistent CUDA launch whose blocks copy the weight rows of the stages ahead into shared
    memory while they wait at the grid barrier (kestrel.ops.linear.cuda_chain), `depth` stages past the current
    one at most (0: each stage's rows copied when it starts; the ring of shared memory bounds it too); each
    configuration checked against the plain-torch chain and timed in a CUDA graph (the counter's memset included),
    us a layer."""
    from kestrel.ops.linear.cuda_chain import CudaGemvChain
    from kestrel.ops.linear.triton_chain import gemv_chain_reference

    want = gemv_chain_reference(x, weights)[-1].float()
    # session 61 (H100): 18.5-20.0 us a layer at depths 0-63 with the fence and add, so the variants: warp 0 (the
    # barrier's) issuing no copies, the arrival a release add, and no barrier at all (the stream and sums alone)
    # (each 18.6-20.5, no barrier 13.1: the 16-byte copies' stream itself was slow), then the weights as bulk
    # copies (tma) and the counter replaced by LL pairs (ll)
    # (18.5-20.5 whichever; no barrier 13.1 with tma, 17.4 with ll too: a stage's rows freed only as a whole hold
    # the stream to about one stage ahead), then `pipe`, a producer warp streaming pages through the ring across the
    # waits: 17.1 with ll; with no barrier 15.4-15.6, yet 8.3-8.7 when the consumers only free the pages (the stream
    # alone, 16-32 KB pages; 8 KB 10.7; four producer lanes no better): the consumers' sums held it (call u); lane 0
    # alone polling each page and four chains of fmas a row made it no better (call v: 18.0 with ll, 16.2 with no
    # barrier, the stream alone 10.0); without the input's read 12.3 against 16.5, and the same on one layer's
    # weights in L2 as from HBM (call w): the input's read waits behind the pages in flight to the same SM, so the
    # ring is swept (fewer pages ahead, a shorter queue in front of each stage's input)
    # (call x: any ring from 64 KB the same; Nsight Compute: the sums latency-bound, every warp polling every page),
    # so own_pages: a page waited for, summed four rows at a time and freed by one warp (call A: the stream alone 7.6,
    # with LL 17.0-17.6, no barrier 14.6); then the consumers' work alone (no_stream), with and without barriers
    # (call C: 15.6 and 10.9: the consumers' own work is most of it), so pipe keeps the stage table in shared memory
    # and the LL input is gathered as bf16 and read back as 16-byte units (Nsight Compute's 43 M shared wavefronts
    # with LL against 5 M without: the fp32 input's reads had 8-way bank conflicts), and `mma`, the sums on the
    # tensor cores (16-row pages, an ldmatrix, an 8-byte load and an mma a 256 weights, where the fmas took 17
    # instructions a lane for 8), by page size, with and without barriers and stream, and with a page's 16 row
    # copies issued by 16 producer lanes (mma_lanes) against lane 0's
    # (session 64, H100: with LL 14.8, 10.1 with mma_lanes, 11.0 with 32 KB pages; the consumers alone 6.9 with LL,
    # barriers alone 3.6; the stream alone 12.2 with lane 0's copies, 8.7 with 16 lanes': the copy a row holds the
    # stream back), so mma_packed: the weights packed in the producer's order, a page one bulk copy, by page size;
    # then the cap (depth), mma_parts, a trace and poll_sleep (calls b-c: packed, the stream alone 7.7-8.2, yet
    # with LL 12.2-16.7 by page size and 11.6-12.0 with no barrier; capping the copies in flight (depth) 10.4 at 2
    # pages (1: 11.7, 4: 12.3), so a stage's input read queues behind them; mma_parts, a page's sums split among
    # 2-8 warps, no better, 12.3-13.2). The sweep keeps what the next steps are measured against; the rest is in
    # bench/results/2026-12-06-h100-session64.json
    alone = dict(pipe=True, mma=True, mma_packed=True, no_barrier=True, no_stream=True)  # the consumers alone
    # the best with its sums pipelined, in 8 KB pages
    small = dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_pipelined=True, page_bytes=8192)
    stream = dict(pipe=True, mma=True, mma_packed=True, no_barrier=True, no_compute=True)  # the stream alone
    # the best so far (session 68): packed, pipelined and folded, 2 pages in flight
    best = dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_pipelined=True, mma_fold=True)
    configs = configs or [
        dict(pipe=True, ll=True, mma=True, mma_lanes=True, depth=2),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2),
        # where a stage's time goes (trace_summary: the input's wait, the sums after it, the producer's lead)
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, trace=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, trace=True),
        dict(pipe=True, mma=True, mma_packed=True, no_barrier=True, trace=True),
        dict(pipe=True, ll=True, mma=True, no_stream=True, trace=True),
        # the consumers alone with no barrier either (session 65, call a: 9.0 us a layer, where the barriers alone
        # take 4.0): a block's own work, traced, then without its sums and without its input's read (call b, H200:
        # 9.85, 5.66 and 9.07), and by page size: whether a page's sums or its handshakes cost
        dict(alone, trace=True),
        dict(alone, no_compute=True),
        dict(alone, no_input=True),
        dict(alone, page_bytes=32768, trace=True),
        dict(alone, page_bytes=8192, trace=True),
        # the pages' mbarriers polled with test_wait, where try_wait may suspend a waiting thread
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, test_wait=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, test_wait=True, trace=True),
        dict(alone, no_compute=True, test_wait=True),
        dict(alone, test_wait=True, trace=True),
        # a block's last tile short of 16 rows folded into its row's segments (mma_fold: mini's 4232 rows leave 8
        # blocks a 1-row tile, 4 pages where 1 holds it, and so 14 pages a layer against a ring of 13)
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_fold=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_fold=True, trace=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_fold=True, test_wait=True),
        dict(alone, mma_fold=True, trace=True),
        dict(alone, mma_fold=True, no_compute=True),
        # a page's sums software-pipelined (mma_pipelined: the next two k-blocks' ldmatrix before this two's mmas);
        # call a (H100): a page's sums 1.3 / 2.0 / 3.0 us at 16 / 32 / 64 k-blocks, about 65 cycles a k-block
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_pipelined=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_pipelined=True, trace=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_pipelined=True, mma_fold=True),
        dict(alone, mma_pipelined=True, trace=True),
        dict(alone, mma_pipelined=True, page_bytes=32768, trace=True),
        # session 67: each consumer warp steps straight to its own pages (next_owned), where all 15 walked every
        # page's setup (86 instructions a page: the more pages, the slower, hence 8 KB's 16.5 us alone in call b),
        # so smaller pages again: a stage's sums over more warps
        dict(small, depth=2),
        dict(small, depth=4),
        dict(small, depth=4, trace=True),
        dict(alone, mma_pipelined=True, page_bytes=8192, trace=True),
        # session 68: with each warp's way to its first page made before the stage's input (call e, H100: 8.71 us a
        # layer against the launches' 9.48, the first chain faster than them), the best's neighbours: traced, the
        # copies in flight, page size, test_wait, poll_sleep
        dict(best, trace=True),
        dict(best, depth=1),
        dict(best, depth=3),
        dict(best, depth=4),
        dict(best, page_bytes=32768, depth=1),
        dict(best, page_bytes=8192, depth=4),
        dict(best, test_wait=True),
        dict(best, poll_sleep=True),
        # session 69: a stage's sums after its input over more warps in smaller pages that still leave one a warp
        # (call e's trace: a 16 KB page's 32 k-blocks summed in 1.2 us in the 4232-row stage, 8 pages at once,
        # against 0.8 in the 2048-row stage's 2): 12 KB (16 x 384: 6 pages a 2048-wide tile, 12 a 32-row block's
        # stage, 24 k-blocks each, 17 slots) and 10 KB (16 x 320: 7 a tile, 14 a stage, at most 20 k-blocks, 21
        # slots; pipelined once a page's columns need only be a multiple of 64)
        dict(best, page_bytes=12288),
        dict(best, page_bytes=12288, depth=3),
        dict(best, page_bytes=12288, trace=True),
        dict(best, page_bytes=10240),
        dict(best, page_bytes=10240, depth=3),
        dict(best, page_bytes=10240, trace=True),
        dict(alone, mma_pipelined=True, mma_fold=True, page_bytes=10240, trace=True),
        # the consumers meet after a stage's stores before polling the next input (store_first; call e's trace:
        # 0.41-0.47 us a stage from the second barrier to consumer 0's row stored, the other threads polling)
        dict(best, store_first=True),
        dict(best, store_first=True, trace=True),
        # the stream alone at the best's cap of copies in flight (call e: 7.97 us a layer uncapped against a floor of
        # 7.09, the best chain 8.71): whether two 16 KB pages a block in flight hold the stream back
        dict(stream, depth=2),
        dict(stream, depth=3, page_bytes=12288),
        # the consumers' polls of the input from L2 put to sleep 128 ns between tries (call a: 10.9 against 10.4)
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, poll_sleep=True),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=3),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, page_bytes=8192, depth=2),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=1),
        dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=4),
        dict(pipe=True, ll=True, mma=True, mma_packed=True),
        dict(pipe=True, mma=True, mma_packed=True, no_barrier=True),
        dict(pipe=True, mma=True, mma_packed=True, no_barrier=True, no_input=True, depth=2),
        stream,
        dict(pipe=True, ll=True, mma=True, mma_lanes=True),
        dict(pipe=True, mma=True, mma_lanes=True, no_barrier=True, no_compute=True),
        dict(pipe=True, ll=True, mma=True),
        dict(pipe=True, ll=True, mma=True, no_stream=True),  # the consumers alone
        dict(pipe=True, mma=True, no_barrier=True, no_stream=True),
        dict(pipe=True, ll=True),  # session 61's pipe
    ]
    return _chain_rows(
        lambda config: CudaGemvChain(weights, **config), configs, x, want, layers, "cuda", "l2_ahead cuda chain",
        lambda chain: {"blocks": chain.blocks, "ring_bytes": chain.ring_bytes, **_chain_trace(chain)},
    )  # fmt: skip


TRACE_DIR: Path | None = None  # main's --out folder: where _chain_trace keeps each traced chain's whole trace


def _chain_trace(chain) -> dict:
    """A traced CudaGemvChain's summary of one more call (its first, cold, already run), and its whole trace kept
    beside the section's JSON (`trace_file`: cuda_chain_trace.compact_trace, for a look at every stage and block
    without a machine): {} untraced."""
    from kestrel.ops.linear.cuda_chain_trace import compact_trace

    if chain.trace is None:
        return {}
    chain()
    torch.cuda.synchronize()
    out = {"trace": chain.trace_summary()}
    if TRACE_DIR is not None:
        path = TRACE_DIR / f"chain_trace_{len(list(TRACE_DIR.glob('chain_trace_*.pt')))}.pt"
        torch.save({"trace": compact_trace(chain.trace), "shapes": chain.shapes}, path)
        out["trace_file"] = path.name
    return out


def _persistent_chain(weights: list, x: torch.Tensor, layers: int, device: str, configs=None) -> list[dict]:
    """The same chain as one persistent launch (kestrel.ops.linear.triton_chain: each program asks L2 for its
    weights `ahead` stages past the next while the stage in front ends), its tiles, L2 lead and grid swept; each
    configuration checked against the plain-torch chain and timed in a CUDA graph (its counters' memset included),
    us a layer. `configs` replaces the sweep (CUDA: programs default to one an SM)."""
    from kestrel.ops.linear.triton_chain import GemvChain, gemv_chain_reference

    want = gemv_chain_reference(x, weights)[-1].float()
    if configs is None and device == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        # session 54 (H100, bench/results/2026-12-05-h100-session54.json): one program an SM, 31-63 us a layer
        # whatever the tiles, K step, L2 requests (own, ahead) or warps; two an SM 30.2. Neither this kernel's K
        # loop nor gemv_triton's is pipelined (no cp.async in their sm_90 PTX): the launches keep their loads in
        # flight with many programs an SM, so the grid is swept here, up to what an SM holds
        configs = [dict(block_n=16, ahead=0, own=True, programs=p * sms) for p in (1, 2, 4, 8)]
        configs += [dict(block_n=32, ahead=0, own=True, programs=p * sms) for p in (2, 4)]
        configs += [
            dict(block_n=16, ahead=1, own=True, programs=4 * sms),
            dict(block_n=16, ahead=0, programs=4 * sms),
        ]
    elif configs is None:
        configs = [dict(block_n=16, ahead=0)]
    return _chain_rows(
        lambda config: GemvChain(weights, x.shape[0], **config), configs, x, want, layers, device,
        "l2_ahead persistent", lambda chain: {"ahead_applied": chain.consts["AHEAD"]},
    )  # fmt: skip


def _chain_rows(
    make, configs: list[dict], x, want, layers: int, device: str, label: str, facts
) -> list[dict]:
    """Each configuration's chain (`make(config)`, a GemvChain or CudaGemvChain) run on x against `want` (its
    last output from the plain-torch chain), then timed in a CUDA graph, us a layer; `facts(chain)`: what else its
    row records. A chain that gave up waiting, or errs by 2% or more, is not ok (no_barrier's are wrong anyway)."""
    rows = []
    for config in configs:
        row = dict(config)
        try:
            chain = make(config)
            chain.input.copy_(x)
            got = chain().float()
            row.update(facts(chain))
            row["rel_err"] = ((got - want).norm() / want.norm()).item()
            row["gave_up"] = chain.gave_up()
            row["ok"] = row["rel_err"] < 2e-2 and not row["gave_up"] or config.get("no_barrier", False)
            row["us_a_layer"] = calls_us([chain], device) / layers
            row["gave_up"] = row["gave_up"] or chain.gave_up()  # the timed calls' too
            del chain
        except Exception as e:  # noqa: BLE001 (a configuration the GPU cannot hold: recorded, the sweep goes on)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(f"{label} {row}", flush=True)
        rows.append(row)
    return rows


def _traced(one, nets, outs, device, rounds: int = 3) -> dict:
    """The one launch traced (kestrel.ops.moe.triton_decode.trace_summary: each program's SM clock and the ns
    timer at its phases' edges), each layer's weights in turn, eager launches one at a time: the spans inside
    the kernel, each the median over the calls of the programs' median and largest, and when the first and
    the last program reached each point."""
    from kestrel.ops.moe.triton_decode import TRACE_POINTS, TRACE_SPANS, trace_summary

    trace = torch.zeros(4096, 16, dtype=torch.int64, device=device)
    calls = []
    for _ in range(rounds):
        for n, o in zip(nets, outs):
            launch = {}
            one(n, o, trace=trace, launch=launch)
            torch.cuda.synchronize()
            calls.append(trace_summary(trace, launch["programs"]))

    def median(values) -> float:
        return float(torch.tensor(values, dtype=torch.float64).median())

    return {
        "calls": len(calls),
        "programs": calls[-1]["programs"],
        "clock_ghz": median([c["clock_ghz"] for c in calls]),
        "spans_us": {
            name: {q: median([c["spans_us"][name][q] for c in calls]) for q in ("median", "max")}
            for name in TRACE_SPANS
        },
        "reached_us": {
            name: {q: median([c["reached_us"][name][q] for c in calls]) for q in ("first", "last")}
            for name in TRACE_POINTS
        },
    }


def moe_fused(result: dict, device: str, smoke: bool, ceilings: dict, save=lambda: None) -> None:
    """The MoE layer at batch 1 in one launch (kestrel.ops.moe.triton_decode.moe_decode_triton) against the six
    it replaces (route_hidden_triton's two, then moe_experts_triton with the shared expert and the residual add
    in its launches: sort, gate_up, down, combine), at mini's sizes: 64 experts of 2048 x 256, top-6, one shared
    expert, fp32 router. Each is timed per layer in a CUDA graph of 24 layers' weights (no L2 reuse between
    calls, as in a step) against the bytes it must read (the 7 experts hit and the router's weight) at the copy
    rate; the one launch's tiles and grid are swept, each checked against the six launches (the same experts,
    the output within bf16 rounding) and for barriers that gave up; the best then runs as three launches with
    no barrier (phased), to show what the barriers cost (session 37: its second version lost to the six;
    session 38: the three launches 38.7 us against the one's 30.9, so not the barriers), then each phase alone
    beside the six launches' router and experts (`by_phase`): which phase loses the time (session 39: both
    expert phases, 3-8x their floors); then, on CUDA, the best traced inside (`trace`: each phase's and each
    barrier's span in the programs, from their clocks). `best_hot_us`: the best over one layer's weights in every
    call (L2-resident: how much of the layer is waiting on HBM).
    `save` writes the JSON after each configuration: a run cut by its time limit keeps the rows it has
    (session 34 lost a whole sweep so)."""
    from kestrel.ops.moe.triton_decode import TILES, barrier_gave_up, moe_decode_triton
    from kestrel.ops.moe.triton_experts import moe_experts_triton
    from kestrel.ops.moe.triton_router import route_hidden_triton

    E, A, D, I, layers, T = 64, 6, 2048, 256, CALLS_PER_STEP, 1
    # session 34's first sweep (ks 1-4, bn_g and bn_d 8-32, 4 warps, one or half a program an SM) put ks 2-4,
    # bn_g 16-32, bn_d 16 first; session 37's (8 and 16 warps a program, one to four K steps unrolled) found
    # nothing faster than 4 warps; session 38's (2-4 programs an SM) 28.0 us at best against 30.9. Session 39's
    # by_phase put gate/up at 15.6 us (floor 3.5) and down at 13.7 (floor 1.7): the down phase now loads every
    # routed slot's tile at once, and ks 1 lets a gate/up item finish h. Its sets: small down tiles (bn_d 4-8,
    # 256-512 items) and gate/up items small enough to keep their loads in registers (bn_g 4-8 x all of D).
    # Session 39's runs of it: 20.4 us at ks 1, bn_g 4, bk_g 512, bn_d 4, bk_d 256, four 4-warp programs an SM
    # (six launches 22.9); 18.8 at bk_g 256; 2-row items, 2 warps, 6-16 programs an SM no better (the grid is
    # capped at the items, 512); gate/up's K steps reduced once (defer) at bk_g 512: 18.1, the default since.
    # Session 40's trace of it (programs' clocks): after the router (1.3 us) and barrier 0 (~0.8 us past the
    # last arrival) each program's routing takes 2.0-3.3 us before its gate/up loads go out; gate/up items 4.4,
    # barrier 1 ~1 us, down 3-5. Tried there and dropped: the routing's picks by one int64 max each (18.13
    # against 18.08 us), L2 prefetches of the router's and shared expert's weights before the PDL wait (17.96
    # against 18.12) and of each program's routed down tiles once routed (19.40); nor were wider router slices
    # (fewer partial logits to read and add when routing: bd 128 18.73, bd 256 24.81 against bd 64's 18.08).
    # Session 43: each program's down weights loaded once it has routed and held in registers through barrier 1
    # (early 1: before its gate/up items; 2: after them; 0: after the barrier, as before): 17.61 us at early 2
    # against 18.05 at 0; early 1 fell back to 0 at these tiles (3 programs an SM), taken at bn_d 8 (20.55).
    # The barriers polled by volatile loads instead of atomics (then one acquiring atomic, or a fence): 19.98 /
    # 20.44 us against 17.40 in the same call; dropped. Session 55 (no GPU lent): router_early, each program's
    # first router item's weights loaded into registers before the PDL wait (not an L2 prefetch), first timed here:
    # 18.66 / 18.62 us against 19.17 / 19.12 without (sessions 56 / 57, H100), the default since; kept as a change.
    # Session 60 (H100): the routing's partial logits read through L1 instead of .cg, 18.65 / 18.65 us against
    # 18.49 / 18.45 in two calls; dropped. A router item one expert's whole logit (router_rows: the routing reads 64
    # logits, no partial rows to add): 18.92 / 18.94 against 18.49 / 18.51; dropped.
    center = dict(TILES)
    configs = [center] + [
        center | change
        for change in (
            dict(router_early=0), dict(early=0), dict(early=1), dict(bd=128), dict(defer=0), dict(bk_g=256),
            dict(bn_g=8, bk_g=256), dict(bn_d=8), dict(warps=2, per_sm=8),
        )
    ]  # fmt: skip
    if smoke:
        E, A, D, I, layers = 8, 2, 64, 32, 2
        configs = [dict(ks=1), dict(ks=1, defer=1), dict(ks=2)]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape, fan_in=1, dt=dtype):
        return (torch.randn(*shape, generator=g, device=device) / fan_in**0.5).to(dt)

    nets = [
        dict(router=r(E, D, fan_in=D, dt=torch.float32), bias=0.1 * r(E, dt=torch.float32),
             w13=r(E, 2 * I, D, fan_in=D), w2=r(E, D, I, fan_in=I), shared=(r(2 * I, D, fan_in=D), r(D, I, fan_in=I)))
        for _ in range(layers)
    ]  # fmt: skip
    x, residual = r(T, D), r(T, D)

    def six(n, out):
        w, ids = route_hidden_triton(x, n["router"], n["bias"], A, True, 2.5)
        moe_experts_triton(x, n["w13"], n["w2"], w, ids, "situ", shared=n["shared"], out=out, accumulate=True)
        return out, w, ids

    def one(n, out, **kw):
        return moe_decode_triton(
            x, n["router"], n["bias"], A, True, 2.5, n["w13"], n["w2"], "situ", shared=n["shared"], out=out,
            accumulate=True, **kw,
        )  # fmt: skip

    outs = [residual.clone() for _ in range(layers)]  # each call adds into its own residual, as in a step
    want, _, want_ids = six(nets[0], residual.clone())
    floor_us = 1e6 * ((A + 1) * 3 * D * I * 2 + E * D * 4) / (ceilings["copy_TBps"] * 1e12)
    entry = result["moe_fused"] = {"experts": E, "top_k": A, "hidden": D, "inter": I, "tokens": T}
    entry["floor_us"] = floor_us
    entry["six_launches_us"] = calls_us([functools.partial(six, n, o) for n, o in zip(nets, outs)], device)
    rows = entry["one_launch"] = []

    def gave_up() -> bool:  # since the last look (a grid not all resident: its results are wrong)
        return device == "cuda" and barrier_gave_up(x.device)

    for tiles in configs:
        row = dict(tiles)
        try:
            launch = {}
            got, _, ids = one(nets[0], residual.clone(), tiles=tiles, launch=launch)
            row["programs"] = launch["programs"]  # capped at what the SMs hold at once
            row["early_taken"] = launch["early"]
            # a grid whose barriers gave up (seconds each) is recorded, not timed
            row["barrier_gave_up"] = gave_up()
            row["close"] = False
            if not row["barrier_gave_up"]:
                delta, ref = (got - residual).float(), (want - residual).float()
                row["same_experts"] = bool(torch.equal(ids, want_ids))
                row["rel_err"] = ((delta - ref).norm() / ref.norm()).item()
                kw = dict(tiles=tiles)
                row["us"] = calls_us([functools.partial(one, n, o, **kw) for n, o in zip(nets, outs)], device)
                row["floor_share"] = floor_us / row["us"]
                row["barrier_gave_up"] = gave_up()  # its timing would be of wrong results
                row["close"] = row["same_experts"] and row["rel_err"] < 1e-2 and not row["barrier_gave_up"]
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
        rows.append(row)
        save()
    entry["default_tiles"] = TILES
    best = entry["best"] = _best(rows)
    if best is not None:
        # the best tiles again as three launches, one a phase, with no grid barrier: what the two barriers cost
        # beside two launches' overhead (the phases' work and bytes are the same)
        tiles = {k: best[k] for k in configs[0]}
        kw = dict(tiles=tiles, phased=True)
        got, _, ids = one(nets[0], residual.clone(), tiles=tiles)
        got3, _, ids3 = one(nets[0], residual.clone(), **kw)
        entry["best_phased"] = {
            "us": calls_us([functools.partial(one, n, o, **kw) for n, o in zip(nets, outs)], device),
            "same_bits_as_one_launch": bool(torch.equal(got, got3) and torch.equal(ids, ids3)),
        }
        # the best over one layer's weights in every call: its 7 experts hit and the router's weight (~23 MB)
        # stay in L2, so this is the layer with no HBM latency on its weights: the ceiling of any prefetching
        # (its routed experts cannot be asked for before the router has run)
        hot = dict(tiles=tiles)
        entry["best_hot_us"] = calls_us([functools.partial(one, nets[0], o, **hot) for o in outs], device)
        save()
        # each phase alone (its inputs left by a whole phased call in the layer's scratch) beside the six
        # launches' two parts, the router's two launches and the experts' four: where the time goes
        scratch = [{} for _ in nets]
        for n, o, sc in zip(nets, outs, scratch):
            one(n, o, scratch=sc, **kw)
        per_layer = list(zip(nets, outs, scratch))
        phase_us = {
            name: calls_us(
                [functools.partial(one, n, o, phases=(phase,), scratch=sc, **kw) for n, o, sc in per_layer],
                device,
            )
            for phase, name in ((1, "router"), (2, "gate_up_and_routing"), (3, "down_and_combine"))
        }
        route_calls = [
            functools.partial(route_hidden_triton, x, n["router"], n["bias"], A, True, 2.5) for n in nets
        ]
        routing = [route() for route in route_calls]
        expert_calls = [
            functools.partial(
                moe_experts_triton,
                x,
                n["w13"],
                n["w2"],
                w,
                i,
                "situ",
                shared=n["shared"],
                out=o,
                accumulate=True,
            )
            for n, o, (w, i) in zip(nets, outs, routing)
        ]
        rate = ceilings["copy_TBps"] * 1e12 / 1e6  # bytes a microsecond
        entry["by_phase"] = {
            # each phase's bytes at the copy rate: the router's fp32 weight; the 7 experts' gate and up; their down
            "floors_us": {
                "router": E * D * 4 / rate,
                "gate_up_and_routing": (A + 1) * 2 * I * D * 2 / rate,
                "down_and_combine": (A + 1) * D * I * 2 / rate,
            },
            "one_launch_phases_us": phase_us,
            "six_router_us": calls_us(route_calls, device),
            "six_experts_us": calls_us(expert_calls, device),
        }
        save()
        if device == "cuda":  # (the interpreter runs no inline PTX)
            entry["trace"] = _traced(functools.partial(one, tiles=tiles), nets, outs, x.device)
            save()
    print(
        f"moe_fused T=1: floor {floor_us:.1f} us, six launches {entry['six_launches_us']:.1f} us a layer, "
        f"one launch best {best}, the same as three launches {entry.get('best_phased')}, by phase "
        f"{entry.get('by_phase')}, traced spans {entry.get('trace', {}).get('spans_us')}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode_kernels.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument(
        "--sections",
        default="moe_sort,mla_decode,mla_layout,moe_tiles,kda_step,moe_anatomy,small_kernels,pdl,gemv,moe_fused,argmax,"
        "sampling,l2_ahead",
    )
    parser.add_argument(
        "--moe-tokens",
        type=lambda v: [int(t) for t in v.split(",")],
        default=[1, 64, 256],
        help="moe_tiles: the token counts to sweep (comma-separated)",
    )
    args = parser.parse_args()
    global TRACE_DIR
    TRACE_DIR = Path(args.out).parent
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        import kestrel.bench.roofline as roofline

        roofline.CPU_TIMED_CALLS = 1  # the code runs; its timings mean nothing here
    started = time.perf_counter()
    result: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "gpu": device_name(device),
    }

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - started
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    ceilings = result["ceilings"] = measure_ceilings(device)
    sections = {
        "moe_sort": lambda: moe_sort(result, device, args.smoke),
        "mla_decode": lambda: mla_decode(result, device, args.smoke, ceilings),
        "mla_layout": lambda: mla_layout(result, device, args.smoke, ceilings),
        "moe_tiles": lambda: moe_tiles(result, device, args.smoke, ceilings, tuple(args.moe_tokens)),
        "kda_step": lambda: kda_step(result, device, args.smoke, ceilings),
        "moe_anatomy": lambda: moe_anatomy(result, device, args.smoke, ceilings),
        "small_kernels": lambda: small_kernels(result, device, args.smoke, ceilings),
        "pdl": lambda: pdl(result, device, args.smoke),
        "gemv": lambda: gemv(result, device, args.smoke, ceilings),
        "moe_fused": lambda: moe_fused(result, device, args.smoke, ceilings, save),
        "argmax": lambda: argmax(result, device, args.smoke, ceilings),
        "sampling": lambda: sampling(result, device, args.smoke, ceilings),
        "l2_ahead": lambda: l2_ahead(result, device, args.smoke, ceilings),
        "gemv_rows": lambda: gemv_rows(result, device, args.smoke, ceilings),
    }
    for name in args.sections.split(","):
        try:
            sections[name]()
        except Exception:  # noqa: BLE001
            result.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            print(f"{name} failed:\n{result['errors'][name]}", flush=True)
        save()
    save()
    print(f"wrote {args.out} in {result['elapsed_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
