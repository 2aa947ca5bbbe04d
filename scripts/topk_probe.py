"""Why is each streaming pass of the DSA radix top-k ~4x off the bandwidth floor? A ladder of one-pass kernels.

`kestrel/ops/dsa/triton_topk.py`'s `_coarse_kernel`, `_fine_kernel` and `_compact_kernel` (grid (S, B), SEG=16384,
BLOCK=4096, 8 warps) each take ~32 us on the H200 for [64, 131072] fp32 scores, though each reads only 33.5 MB
(~8 us at the 4.25 TB/s copy ceiling). This script times single-pass kernels over the same tensor with the same
grid and access pattern (masked 16-byte loads in a runtime-bounded loop over BLOCK-wide tiles), adding one piece of
work at a time, so the step where the time appears names the cause:
  load_vacc     loads, elementwise accumulate, one reduction at the end (the floor of the access pattern)
  load_sum      loads, a tl.sum per tile (the per-tile cross-warp reduction the histogram kernels also pay)
  key_sum       + the `_sort_key` transform, sum of keys (mod 2^32)
  hist64_mask   + tl.histogram of the top 6 key bits with mask= (what `_coarse_kernel` does)
  hist64_nomask the same without mask= (invalid keys have key 0, so they land in bin 0)
  hist16_mask, hist256_mask   cost against bins
  sweep         hist64_mask over SEG x BLOCK x num_warps (occupancy and memory-level parallelism)
  empty         the same grid, no loads (launch and tail cost)
  torch_topk, clone           the ceilings
Then what `_compact_kernel` does instead of a histogram (no histogram, a tl.cumsum per tile, scattered stores;
also ~32 us), split the same way. The flag stands for its `take` (top 11 key bits >= the threshold bin b1): the
top 6 key bits >= FLAG_BIN = 48, i.e. x >= 2.0, ~2.3% of randn (its candidates: 3-6 K of 131072 per row, 2-5%):
  flag_sum      + the flag, tl.sum of it per tile (the control: everything but the scan)
  cumsum_block  + tl.cumsum of the 0/1 flag over the tile, summing its last element (the scan's cost)
  compact_cumsum  the whole compaction as `_compact_kernel` does it: slot = base + cumsum - 1, (key, position)
                stored to the program's region, base += tl.sum (the scattered stores' cost, over cumsum_block)
  compact_atomic  the same with slot = tl.atomic_add(counter, 1, mask=flag) per element instead of the scan
                (default sem, acq_rel; order within a program arbitrary); compact_atomic_relaxed: sem="relaxed"
  flag_sum_small, cumsum_small   flag_sum and cumsum_block with BLOCK / 4 at 1 warp (the scan inside one warp,
                no cross-warp step) and at 4 warps: is the cross-warp step of the scan the cost?
Each is timed cold (L2 flushed before every rep: the 33.5 MB tensor fits the H200's 50 MB L2) and warm.
Each Triton variant's result is checked against torch before it is timed.

    python3 scripts/topk_probe.py --out $OUT          # GPU: writes $OUT/topk_probe.json, one JSON line each
    python3 scripts/topk_probe.py --smoke --out /tmp/probe   # tiny sizes, checks (CPU: TRITON_INTERPRET=1)
    python3 scripts/topk_probe.py --out $OUT --only load_vacc,flag_sum,cumsum_block   # a subset of the names
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.ops.dsa.triton_topk import _sort_key  # noqa: E402

LOAD_VACC, LOAD_SUM, KEY_SUM, HIST_MASK, HIST_NOMASK = range(5)  # MODE; the kernel spells them as literals
FLAG_SUM, CUMSUM, COMPACT_CUMSUM, COMPACT_ATOMIC = range(5, 9)  # MODE of _scan_kernel
FLAG_BIN = 48  # flag = top 6 key bits >= 48, i.e. x >= 2.0: ~2.3% of randn
NAMES = (  # every row the probe can write, in ladder order; --only picks from these
    "empty",
    "load_vacc",
    "load_sum",
    "key_sum",
    "hist64_mask",
    "hist64_nomask",
    "hist16_mask",
    "hist256_mask",
    "sweep_hist64_mask",
    "flag_sum",
    "cumsum_block",
    "compact_cumsum",
    "compact_atomic",
    "compact_atomic_relaxed",
    "flag_sum_small",
    "cumsum_small",
    "torch_topk",
    "clone",
)


@triton.jit
def _probe_kernel(
    x_ptr,
    sum_ptr,
    hist_ptr,
    L,
    stride_b,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    NB: tl.constexpr,
    SHIFT: tl.constexpr,
):
    seg = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    num_segs = tl.num_programs(0)
    start = seg * SEG
    end = tl.minimum(start + SEG, L)
    vacc = tl.zeros([BLOCK], dtype=tl.float32)
    facc = tl.zeros([], dtype=tl.float32)
    kacc = tl.zeros([], dtype=tl.uint32)
    hist = tl.zeros([NB], dtype=tl.int32)
    for off in range(start, end, BLOCK):
        p = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + b * stride_b + p, mask=p < L, other=float("nan"))  # as _coarse_kernel loads
        if MODE == 0:  # LOAD_VACC
            vacc += x
        elif MODE == 1:  # LOAD_SUM
            facc += tl.sum(x, 0)
        else:
            key = _sort_key(x, p < end)
            if MODE == 2:  # KEY_SUM
                kacc += tl.sum(key, 0)
            elif MODE == 3:  # HIST_MASK
                hist += tl.histogram((key >> SHIFT).to(tl.int32), NB, mask=key != 0)
            else:
                hist += tl.histogram((key >> SHIFT).to(tl.int32), NB)
    out = b * num_segs + seg
    if MODE == 0:
        tl.store(sum_ptr + out, tl.sum(vacc, 0).to(tl.float64))
    elif MODE == 1:
        tl.store(sum_ptr + out, facc.to(tl.float64))
    elif MODE == 2:
        tl.store(sum_ptr + out, kacc.to(tl.int64).to(tl.float64))
    else:
        tl.store(hist_ptr + out * NB + tl.arange(0, NB), hist)


@triton.jit
def _scan_kernel(
    x_ptr,
    cnt_ptr,  # [B * S] int32: flagged keys per program (COMPACT_ATOMIC: the slot counter)
    key_out_ptr,  # [B * S, SEG] int32: the program's flagged keys (uint32 bits), first cnt valid
    pos_out_ptr,  # [B * S, SEG] int32: their positions in the row
    L,
    stride_b,
    SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    MODE: tl.constexpr,
    FLAG_BIN: tl.constexpr,
    RELAXED: tl.constexpr,
):
    """The loop of `_probe_kernel`, flagging the keys that `_compact_kernel` would take and counting or
    compacting them."""
    seg = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    num_segs = tl.num_programs(0)
    start = seg * SEG
    end = tl.minimum(start + SEG, L)
    out = b * num_segs + seg
    i = tl.arange(0, BLOCK)
    cnt = tl.zeros([], dtype=tl.int32)
    if MODE == 8:  # COMPACT_ATOMIC: the counter is zeroed here, so that no memset joins the timing
        tl.store(cnt_ptr + out, 0)
        tl.debug_barrier()
    for off in range(start, end, BLOCK):
        p = off + i
        x = tl.load(x_ptr + b * stride_b + p, mask=p < L, other=float("nan"))  # as _compact_kernel loads
        key = _sort_key(x, p < end)
        flag = (key >> 26).to(tl.int32) >= FLAG_BIN  # key 0 (invalid) is in bin 0: never flagged
        flag_i = flag.to(tl.int32)
        if MODE == 5:  # FLAG_SUM
            cnt += tl.sum(flag_i, 0)
        elif MODE == 6:  # CUMSUM
            cnt += tl.sum(tl.where(i == BLOCK - 1, tl.cumsum(flag_i, 0), 0), 0)
        elif MODE == 7:  # COMPACT_CUMSUM, as _compact_kernel
            slot = out * SEG + cnt + tl.cumsum(flag_i, 0) - 1
            tl.store(key_out_ptr + slot, key.to(tl.int32, bitcast=True), mask=flag)
            tl.store(pos_out_ptr + slot, p, mask=flag)
            cnt += tl.sum(flag_i, 0)
        else:  # COMPACT_ATOMIC: one vector atomic on the program's counter
            ctr = cnt_ptr + out + tl.zeros([BLOCK], dtype=tl.int64)
            if RELAXED:
                old = tl.atomic_add(ctr, 1, mask=flag, sem="relaxed")
            else:
                old = tl.atomic_add(ctr, 1, mask=flag)
            slot = out * SEG + old
            tl.store(key_out_ptr + slot, key.to(tl.int32, bitcast=True), mask=flag)
            tl.store(pos_out_ptr + slot, p, mask=flag)
    if MODE != 8:
        tl.store(cnt_ptr + out, cnt)


def torch_keys(x: torch.Tensor) -> torch.Tensor:
    """`_sort_key` in torch: int64 holding the uint32 key (NaN -> 0)."""
    u = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(u >> 31 != 0, ~u & 0xFFFFFFFF, u | 0x80000000)
    return torch.where(torch.isnan(x), torch.zeros_like(key), key)


def launch(x, mode, seg, block, warps, nb=64, length=None, relaxed=False):
    """One probe pass over x [B, L]. `_probe_kernel`: (per-program sums [B, S] float64, histograms [B, S, NB]);
    `_scan_kernel`: (per-program counts [B, S], compacted keys [B, S, SEG], positions [B, S, SEG])."""
    B, L = x.shape
    S = triton.cdiv(L, seg)
    n = L if length is None else length
    if mode >= FLAG_SUM:
        cnt = torch.empty(B, S, dtype=torch.int32, device=x.device)
        keys = torch.empty(B, S, seg if mode >= COMPACT_CUMSUM else 1, dtype=torch.int32, device=x.device)
        pos = torch.empty_like(keys)
        _scan_kernel[(S, B)](
            x,
            cnt,
            keys,
            pos,
            n,
            x.stride(0),
            SEG=seg,
            BLOCK=block,
            MODE=mode,
            FLAG_BIN=FLAG_BIN,
            RELAXED=relaxed,
            num_warps=warps,
        )
        return cnt, keys, pos
    sums = torch.empty(B, S, dtype=torch.float64, device=x.device)
    hist = torch.empty(B, S, nb, dtype=torch.int32, device=x.device)
    shift = 32 - (nb.bit_length() - 1)
    _probe_kernel[(S, B)](
        x, sums, hist, n, x.stride(0), SEG=seg, BLOCK=block, MODE=mode, NB=nb, SHIFT=shift, num_warps=warps
    )
    return sums, hist


def check(x, mode, seg, nb, sums, hist):
    """Compares one pass's result with torch; raises on a mismatch."""
    B, L = x.shape
    S = sums.shape[1]
    xs = x.double().view(B, S, seg)
    if mode in (LOAD_VACC, LOAD_SUM):
        torch.testing.assert_close(
            sums, xs.sum(-1), rtol=1e-4, atol=1e-2, equal_nan=True
        )  # smoke plants NaNs
        return
    keys = torch_keys(x).view(B, S, seg)
    if mode == KEY_SUM:
        ref = (keys.sum(-1) & 0xFFFFFFFF).double()
        got = (sums.to(torch.int64) & 0xFFFFFFFF).double()
        assert torch.equal(got, ref), f"key sums differ: {got} vs {ref}"
        return
    bins = keys >> (32 - (nb.bit_length() - 1))
    prog = torch.arange(B * S, device=x.device).view(B, S, 1) * nb
    idx = (prog + bins) if mode == HIST_NOMASK else (prog + bins)[keys != 0]
    ref = torch.bincount(idx.flatten(), minlength=B * S * nb).view(B, S, nb).to(torch.int32)
    assert torch.equal(hist, ref), f"histograms differ ({(hist != ref).sum().item()} bins)"


def check_scan(x, mode, seg, cnt, keys, pos):
    """Compares one `_scan_kernel` pass with torch: the counts, and the compacted (key, position) pairs, in
    position order (COMPACT_CUMSUM) or as a set (COMPACT_ATOMIC); raises on a mismatch."""
    B, L = x.shape
    S = cnt.shape[1]
    ref_keys = torch_keys(x).view(B, S, seg)
    flag = (ref_keys >> 26) >= FLAG_BIN
    ref_cnt = flag.sum(-1).to(torch.int32)
    assert torch.equal(cnt, ref_cnt), f"counts differ: {cnt} vs {ref_cnt}"
    if mode < COMPACT_CUMSUM:
        return
    valid = torch.arange(seg, device=x.device) < cnt.unsqueeze(-1)  # [B, S, SEG]: the first cnt slots
    pos = torch.where(valid, pos, L)  # slots past the count are not written
    if mode == COMPACT_ATOMIC:  # slots in arbitrary order: sort the pairs by position
        pos, order = pos.sort(-1)
        keys = keys.gather(-1, order)
    ref_pos = torch.arange(L, device=x.device).view(1, S, seg).expand(B, S, seg)[flag]
    got_pos = pos[valid].to(torch.int64)
    assert torch.equal(got_pos, ref_pos), f"positions differ ({(got_pos != ref_pos).sum().item()})"
    got_keys = keys[valid].to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got_keys, ref_keys[flag]), "keys differ"


def timeit(fn, reps, flush):
    """Median microseconds of fn over reps (CUDA events, L2 flushed before each rep when flush); CPU: wall time."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if flush:
            cache.zero_()
        torch.cuda._sleep(1_000_000)  # keeps the GPU busy while the host enqueues: launch latency stays out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for topk_probe.json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one rep (CPU: the Triton interpreter)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--only", help=f"comma-separated row names to run, of: {','.join(NAMES)}")
    args = ap.parse_args()
    only = set(NAMES) if args.only is None else set(args.only.split(","))
    if only - set(NAMES):
        ap.error(f"--only: unknown names {sorted(only - set(NAMES))}; known: {','.join(NAMES)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: use --smoke")
    smoke = args.smoke  # on a GPU: tiny sizes compiled for the device, one timed rep
    device = "cuda" if cuda else "cpu"
    B, L, K = (2, 8192, 64) if smoke else (64, 131072, 2048)
    seg0, block0, warps0 = (2048, 512, 4) if smoke else (16384, 4096, 8)
    sweep = (
        ([1024, 2048], [256, 512], [4])
        if smoke
        else ([4096, 8192, 16384, 32768], [1024, 2048, 4096], [4, 8, 16])
    )
    reps = 1 if smoke else args.reps

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(B, L, device=device, generator=g)
    if smoke:  # exercise the key edge cases: NaN (invalid, key 0), -0.0 and +0.0, infinities
        x[0, :4] = torch.tensor([float("nan"), -0.0, 0.0, float("-inf")])
        x[1, 100:103] = torch.tensor([float("inf"), float("nan"), float("nan")])
    nbytes = B * L * 4

    results = []

    def record(name, fn, moved=nbytes, **params):
        assert name in NAMES, name
        if name not in only:
            return
        row = {"name": name, **params}
        for mode in ("cold", "warm"):
            us = timeit(fn, reps, flush=mode == "cold")
            row[f"us_{mode}"] = round(us, 2)
            row[f"gbps_{mode}"] = round(moved / us / 1e3, 1)
        results.append(row)
        print(json.dumps(row), flush=True)

    n_flag = int(((torch_keys(x) >> 26) >= FLAG_BIN).sum())

    def probe(name, mode, seg=seg0, block=block0, warps=warps0, nb=64, length=None, relaxed=False):
        assert block <= seg and L % seg == 0
        if name not in only:
            return
        res = launch(x, mode, seg, block, warps, nb, length, relaxed)
        if mode >= FLAG_SUM:
            check_scan(x, mode, seg, *res)
            params = {"flag_bin": FLAG_BIN, "flagged": round(n_flag / (B * L), 4)}
            moved = nbytes + (8 * n_flag if mode >= COMPACT_CUMSUM else 0)  # + the (key, position) stores
        else:
            if length is None:
                check(x, mode, seg, nb, *res)
            params = {"bins": nb}
            moved = nbytes if length is None else 0
        record(
            name,
            lambda: launch(x, mode, seg, block, warps, nb, length, relaxed),
            moved,
            seg=seg,
            block=block,
            warps=warps,
            **params,
            checked=length is None,
        )

    probe("empty", LOAD_VACC, length=0)
    probe("load_vacc", LOAD_VACC)
    probe("load_sum", LOAD_SUM)
    probe("key_sum", KEY_SUM)
    probe("hist64_mask", HIST_MASK)
    probe("hist64_nomask", HIST_NOMASK)
    probe("hist16_mask", HIST_MASK, nb=16)
    probe("hist256_mask", HIST_MASK, nb=256)
    for seg in sweep[0]:
        for block in sweep[1]:
            for warps in sweep[2]:
                if block <= seg:
                    probe("sweep_hist64_mask", HIST_MASK, seg=seg, block=block, warps=warps)
    probe("flag_sum", FLAG_SUM)
    probe("cumsum_block", CUMSUM)
    probe("compact_cumsum", COMPACT_CUMSUM)
    probe("compact_atomic", COMPACT_ATOMIC)
    probe("compact_atomic_relaxed", COMPACT_ATOMIC, relaxed=True)
    for warps in (1, 4):  # BLOCK / 4 (1024 on the GPU): at 1 warp the scan never crosses warps
        probe("flag_sum_small", FLAG_SUM, block=block0 // 4, warps=warps)
        probe("cumsum_small", CUMSUM, block=block0 // 4, warps=warps)
    record("torch_topk", lambda: torch.topk(x, K, dim=-1), k=K)
    record("clone", lambda: x.clone(), moved=2 * nbytes)  # read + write

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1: times mean nothing)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": [B, L],
        "reps": reps,
        "timing": "median us; cold = 256 MiB L2 flush before each rep, warm = none; gbps = bytes moved / time",
        "smoke": smoke,
        "only": args.only,
    }
    (out / "topk_probe.json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    print(f"wrote {out / 'topk_probe.json'}: {len(results)} rows, all checks passed", flush=True)


if __name__ == "__main__":
    main()
