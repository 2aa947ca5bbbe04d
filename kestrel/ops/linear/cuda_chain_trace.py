"""The CUDA chain's trace (`CudaGemvChain(..., trace=True)`, cuda_chain.cu's trace_point) summed up: where each
stage's time goes, on the blocks' clocks lined up by the ns timer. cuda_chain.py's docstring has what the traces
found."""

from __future__ import annotations

import torch

# mma's trace (`trace=True`; cuda_chain.cu's trace_point): each block's row of each stage takes the SM clock at
# these points ([k]), from consumer thread 0 (0-3, 10), the producer's lane 0 (4-5: with the ns timer too, at
# [16 + k]) and the warps of the stage's first and last page (6-9)
TRACE_POINTS = (
    "start",
    "input in",
    "pages summed",
    "stored",
    "first page free",
    "last page issued",
    "first page in",
    "last page in",
    "first page summed",
    "last page summed",
    "input gathered",
)
TRACE_WIDTH = 32  # cuda_chain.cu's kTraceWidth: 16 clocks, 16 timer values
TIMED_POINTS = (4, 5)  # the points that read the ns timer


def block_row_counts(N: int, blocks: int) -> torch.Tensor:
    """The rows each of `blocks` blocks holds of a stage of N rows (cuda_chain.cu's block_first_row)."""
    b = torch.arange(blocks + 1)
    first = N * b // blocks
    return first[1:] - first[:-1]


def _offsets(trace: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A trace's clocks from each block's first and its timer values from the first of them, in int64 (0 where
    not recorded), with the masks of the points recorded (a clock) and timed (a clock and the timer)."""
    t = trace.detach().cpu().long()
    cyc, ns = t[..., :16], t[..., 16:]
    rec = cyc > 0
    timed = (ns > 0) & rec
    c0 = torch.where(rec, cyc, torch.iinfo(torch.int64).max).amin(
        dim=(1, 2), keepdim=True
    )  # each block's first
    ns0 = ns[timed].min() if timed.any() else 0
    return torch.where(rec, cyc - c0, 0), torch.where(timed, ns - ns0, 0), rec, timed


def aligned_us(trace: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Every block's points on one time line, us, [blocks, stages, 16] (NaN where a point was not recorded: clock 0),
    and the SM clock in GHz: a least-squares line ns = a cycles + c a block over its timed points (TIMED_POINTS). The
    ns timer is common to the SMs; the clock is fine but each SM's own; the line gives each block's clock the
    timer's origin. Both are taken relative to their first value in int64 first (_offsets): the timer's ns since
    1970 (~1.7e18) would otherwise keep only 256-ns steps in a double. A block whose timed points span under 1000
    cycles (one stage, or no rows in any: its producer's points all at the start) takes the other blocks' median
    slope and fits its offset alone; a block with none is NaN throughout."""
    dc, dns, rec, timed = _offsets(trace)
    assert timed.any(), "no traced call yet"
    x, y = dc.double(), dns.double()
    n = timed.sum(dim=(1, 2))
    cx = torch.where(timed, x, 0).sum(dim=(1, 2)) / n.clamp(min=1)
    cy = y.sum(dim=(1, 2)) / n.clamp(min=1)
    dx = torch.where(timed, x - cx[:, None, None], 0)
    dy = torch.where(timed, y - cy[:, None, None], 0)
    a = (dx * dy).sum(dim=(1, 2)) / (dx * dx).sum(dim=(1, 2)).clamp(min=1e-9)
    span = torch.where(timed, x, float("-inf")).amax(dim=(1, 2)) - torch.where(timed, x, float("inf")).amin(
        dim=(1, 2)
    )
    fitted = (n >= 2) & (span >= 1000)
    assert fitted.any(), "no block's timed points span 1000 cycles"
    a = torch.where(fitted, a, a[fitted].median())
    at = (a[:, None, None] * (x - cx[:, None, None]) + cy[:, None, None]) / 1e3
    at = torch.where(rec & (n > 0)[:, None, None], at, float("nan"))
    return at, 1.0 / a[fitted].median().item()


def _nan_stat(stat):
    """`stat` (torch.median, torch.max) of a tensor's recorded values as a float: NaN where there are none."""

    def of(v: torch.Tensor) -> float:
        v = v[~v.isnan()]
        return stat(v).item() if v.numel() else float("nan")

    return of


_med, _top = _nan_stat(torch.median), _nan_stat(torch.max)
# by_class's figures a stage: (name, from point, to point); "prev" is the last store of the stage before among the
# blocks whose rows the stage reads (with LL a block waits for those alone)
_STAGE_SPANS = (
    ("latency", "prev", 1),  # the input in (after the consumers' sync)
    ("gathered", "prev", 10),  # consumer 0's share of it in
    # the first page's warp through its wait, from the input in: a few cycles below 0 can be, where that warp
    # passes the consumers' sync before consumer 0 does
    ("first_page_wait", 1, 6),
    ("first_page_sums", 6, 8),  # that page summed
    ("last_page_wait", 1, 7),
    ("last_page_sums", 7, 9),
    ("sums", 1, 2),  # every page summed (the consumers' sync)
    ("stores", 2, 3),
    # the producer's issue of the stage's pages, from its first page's slot free to its last page issued: with no
    # stream (each page completed on its slot's release) the pace its handshakes allow
    ("pages_issued", 4, 5),
)


def _by_class(at: torch.Tensor, paged: torch.Tensor, shapes: list[tuple[int, int]]) -> dict:
    """Per stage shape ("NxK"), the medians over its stages past the first layer (the first len(set(shapes))
    stages, the ring starting empty: a layer's stages are taken to differ in shape) of each _STAGE_SPANS span, us:
    the median over the blocks with rows in the stage, and the critical block's (the last of them to store:
    `critical_` keys), whose spans make up the stage's period (from the producers' last store, "prev", to the
    stage's last store); `latency_max`, the last of them to have its input in; `rows` and `critical_rows`, the rows
    a block holds (the median's and the critical block's). `at` is aligned_us's [blocks,
    stages, points], `paged` [blocks, stages] where a block has rows."""
    blocks = at.shape[0]
    b = torch.arange(blocks)
    warm = max(1, len(set(shapes)))
    rows: dict[str, list[dict]] = {}
    for s in range(warm, at.shape[1]):
        (n_prev, _), (_, k) = shapes[s - 1], shapes[s]
        # the blocks holding stage s - 1's first k rows
        producers = (n_prev * b // blocks < k) & paged[:, s - 1]
        prev = torch.nan_to_num(at[producers, s - 1, 3], nan=float("-inf")).max()
        a = at[paged[:, s], s]
        if not a.shape[0]:
            continue
        c = int(torch.nan_to_num(a[:, 3], nan=float("-inf")).argmax())
        row = {"period": (a[c, 3] - prev).item(), "latency_max": _top(a[:, 1] - prev)}
        # the rows a block holds, and the critical block's (whether the blocks with a row more are the last)
        held = block_row_counts(shapes[s][0], blocks)[paged[:, s]].double()
        row["rows"], row["critical_rows"] = held.median().item(), held[c].item()
        for name, i, j in _STAGE_SPANS:
            span = a[:, j] - (prev if i == "prev" else a[:, i])
            row[name] = _med(span)
            row[f"critical_{name}"] = span[c].item()
        rows.setdefault(f"{shapes[s][0]}x{shapes[s][1]}", []).append(row)
    out = {}
    for label, stages in rows.items():
        col = {key: torch.tensor([r[key] for r in stages], dtype=torch.float64) for key in stages[0]}
        out[label] = {"stages": len(stages), "period_mean": col["period"].mean().item()}
        out[label] |= {key: _med(v) for key, v in col.items()}
    return out


def chain_trace_summary(trace: torch.Tensor, shapes: list[tuple[int, int]] | None = None) -> dict:
    """CudaGemvChain.trace_summary on a trace [blocks, stages, TRACE_WIDTH] (clocks at [k], the timer at [16 + k]
    for TIMED_POINTS), us, on the blocks' clocks lined up (aligned_us). The spans of a block with no rows in a
    stage (no first page) are left out. With `shapes` (each stage's N, K), `by_class` has _by_class's figures."""
    assert trace.shape[-1] == TRACE_WIDTH, f"a trace row is {TRACE_WIDTH} values"
    if shapes is not None:
        assert len(shapes) == trace.shape[1], f"{len(shapes)} shapes for {trace.shape[1]} stages"
    at, ghz = aligned_us(trace)
    paged = ~at[..., 4].isnan()  # a block with no rows in a stage has no first page

    def spread(us: torch.Tensor) -> dict:  # over the blocks' stages with rows
        return {"median": _med(us[paged]), "max": _top(us[paged])}

    def across(us: torch.Tensor) -> dict:
        return {"median": _med(us), "max": _top(us)}

    last = torch.nan_to_num(at, nan=float("-inf")).max(dim=0).values  # [stages, points]: the last block's
    out = {
        "blocks": trace.shape[0],
        "stages": trace.shape[1],
        "clock_ghz": ghz,
        "input_wait_us": spread(at[..., 1] - at[..., 0]),
        "pages_after_input_us": spread(at[..., 2] - at[..., 1]),
        "stores_us": spread(at[..., 3] - at[..., 2]),
        "first_page_ahead_us": spread(at[..., 0] - at[..., 4]),
        "last_page_ahead_us": spread(at[..., 1] - at[..., 5]),
    }
    if trace.shape[1] > 1:  # across the blocks: a stage's values, not a block's
        out["stage_period_us"] = across(last[1:, 3] - last[:-1, 3])
        out["input_latency_us"] = across(last[1:, 1] - last[:-1, 3])
        if shapes is not None:
            out["by_class"] = _by_class(at, paged, shapes)
    return out


def compact_trace(trace: torch.Tensor) -> torch.Tensor:
    """A trace as int32 offsets, for keeping (chain_trace_summary reads it as it reads the kernel's): _offsets plus
    one where recorded, so that 0 still means "not recorded". A launch's clocks span well under 2^31 cycles (a
    second at 2 GHz)."""
    dc, dns, rec, timed = _offsets(trace)
    out = torch.cat([torch.where(rec, dc + 1, 0), torch.where(timed, dns + 1, 0)], dim=-1)
    assert out.max() < 2**31, "a trace spanning 2^31 cycles or ns"
    return out.to(torch.int32)
