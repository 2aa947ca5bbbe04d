"""The whole MoE layer of a decode step in one launch: router, routed experts, shared expert, combine and the
residual add. `moe_decode_triton` is, in one kernel, what the layer otherwise runs as six (the router's two,
`route_hidden_triton`; the pair sort, gate_up, down and combine of `moe_experts_triton` with the shared expert
in its launches): issue 4's first step towards a decode step of few launches.

Legend: T tokens (decode: 1), D hidden width (= the experts' input), E experts, A experts per token, I expert
width, SL = A (+ 1 with a shared expert) slots a token's experts fill, S slices of D the router's logits are
summed over, KS slices of D each gate/up product is summed over.

One grid, every program resident at once, walks three phases; a grid barrier (an atomic counter each program
adds to, then waits on) separates them:
    router:   partial[t, s] = x[t, slice s] . router_weight[:, slice s]                 T * S items   [T, S, E]
    gate_up:  every program sums partial[t] in a fixed order and routes (top-A with the correction bias, as
              `triton_router._pick`: the same weights and ids in every program, no barrier for them; program 0
              stores them); gu[t, a, ks] = x[t, slice ks] . w13[e_a, tile]  (gate, up; fp32)  T * SL * I / BN * KS
              With one slice (ks 1, the default) an item has the whole sum and stores h = act(gate, up) itself.
    down:     the routing program 0 stored; h (stored, or made from the KS partial sums); every routed slot's
              weight tile in one load [BA, BN, BK] issued before h is read; out[t, tile] (+)= sum_a w_a *
              (h_a . w2[e_a, tile]) in slot order (+ the shared expert's)                T * D / BN items
The rounding is `moe_experts_triton`'s (gate and up in x's dtype, the activation in fp32, h and each expert's
output in x's dtype, the fp32 weighted sum in slot order; the shared expert's output and the residual each
added to the rounded sum, rounded again); its only differences from the six launches are summation orders
(the router's logits over slices of another width, gate/up over KS slices of D).

The barriers need every program resident: the grid is at most what the SMs hold at once, which the first launch
of each set of constants reads from the compiled kernel (its registers, threads and shared memory:
`kestrel.ops.occupancy.programs_an_sm`), and at most the items. The counters (`_sync`, one small buffer a device,
left at zero by every launch) are reset by the kernel itself, so CUDA graphs replay it as is; two launches must
not run at once on one device (one stream: a decode step). A barrier that waits past MAX_SPIN polls (seconds: a
grid that cannot all be resident) gives up and sets sync[3], which the tests check. Triton's CPU interpreter runs
a program to its end before the next starts, so a barrier would never open there: on the CPU (and with
phased=True) the three phases run as three launches of the same kernel, and the tests on the GPU compare the one
launch with them, bit for bit.

Inference only (no autograd); one dtype for x and every expert weight; the router weight and bias fp32.

Measured on the H200 (scripts/decode_kernels_check.py --sections moe_fused; mini's sizes, a CUDA graph of 24
layers' weights, us a layer; the six launches 22.9, 5.3 us of bytes at the copy rate). Sessions 34-38's
versions (one program an SM, large tiles, each down item's slots one after another) lost to the six: 28-31 us.
Session 39 timed each phase alone (gate/up 15.6 us against 3.5 of bytes, down 13.7 against 1.7), then: the
down phase's slots in one load (13.7 -> 6.4 us alone), gate/up items of 4 rows x all of D finishing h, four
4-warp programs an SM (512, one item each): 18.8-20.4 us a layer; gate/up's K steps reduced once at the end
(defer; 12.4 -> 9.2 us alone): **18.1 us**, the six launches' experts and output bit for bit. mini's batch-1
step 1.67 -> 1.56 ms (graph replay), so it is on by default (KESTREL_MOE_FUSED_DECODE). The shared expert's
gate/up beside the router (it needs no routing) was slower: 21.5 us. `phases` and `scratch` let one phase be
timed alone, and `trace` stamps each program's clock at the phases' edges (session 40, 18.1 us a layer: the
router done by 1.3 us, barrier 0 passed ~0.8 us later, each program's routing 2.0-3.3 us before its gate/up
loads go out, gate/up done by 10.0, barrier 1 ~1 us, down done by 16.4). Tried there, no faster, dropped: the
routing's top-A by one packed int64 max a pick (18.13 against 18.08 us); L2 prefetches of the router's and the
shared expert's weights before the PDL wait (17.96 against 18.12) and of each program's routed down tiles once
it has routed (19.40); wider router slices, fewer partial logits to add when routing (bd 128: 18.73 us).
Session 43 loads each program's down tiles into registers once its gate/up items are done and holds them
through barrier 1 (TILES' early 2): 18.05 -> **17.61 us** a layer (17.89 -> 17.40 in a second call), the
same bits; barrier 1's wait grows (the loads land before the arrival's release) and the down phase after it
falls from ~5 to 2.8 us. Loaded before the gate/up items (early 1) the registers held leave room for 3
programs an SM, too few for the 512 down items. mini's batch-1 step was level within the noise: 1.432-1.445
ms either way. Barriers polled by volatile loads instead of atomics were slower (19.98-20.44 us).
Session 55 (no GPU lent): TILES' router_early loads each program's first router item's weights into registers
before the PDL wait (session 40's L2 prefetch of them saved 0.16 us); its sm_90 PTX has the slice's eight 16-byte
loads a thread before `griddepcontrol.wait`; the interpreter's tests give the same bits as without; off until
scripts/decode_kernels_check.py's moe_fused (job `moe`) has timed it. Timed in sessions 56 and 57 (H100): 19.17 ->
18.66 and 19.12 -> 18.62 us a layer, the same bits; on by default since. Session 60 (H100) read the routing's
partial logits through L1 (plain loads after barrier 0's acquiring polls, so an SM's four programs could share
them) instead of past it (.cg): 18.65 against 18.49 and 18.65 against 18.45 us in two calls, the same bits;
dropped. Its trace there: barrier 0 passed at ~2 us, every program routed by 3.8-5.4, the gate/up items done by
5.1-11.3 (their bytes alone 4.8 us), barrier 1 passed at ~13, down done by ~16. Then router_rows, a router item one
expert's whole logit (its router row, loaded before the PDL wait, against the hidden row: 64 items a token) instead
of a slice of D for every expert, so the routing reads 64 logits instead of adding 32 partial rows: 18.92 / 18.94
against 18.49 / 18.51 us in two calls (H100), the same experts; dropped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.activation.triton_act import glu
from kestrel.ops.grid_sync import grid_arrive, grid_wait
from kestrel.ops.moe.triton_experts import _rounded
from kestrel.ops.moe.triton_router import _pick, _slice_dot, _slice_logits, _slice_weights, _summed_logits
from kestrel.ops.occupancy import programs_an_sm
from kestrel.ops.pdl import pdl_args, pdl_launch_next, pdl_wait

MAX_SPIN = 1 << 22  # polls of a barrier's counter before it gives up (~1 us each)
_sync: dict[
    torch.device, torch.Tensor
] = {}  # device -> its barrier counters [4] int32, zero between launches
# (router slice, gate/up K slices, gate/up tile and K step, down tile and K step): the defaults on the GPU
# and warps a program, programs an SM (the grid: at most what the GPU holds at once); defer: a gate/up item
# adds its K steps' products elementwise and reduces once, instead of reducing each step
# early: with one token, each program's down weights loaded before its gate/up items (1) or after them (2),
# held through barrier 1 (0: loaded after it), where the grid holds every down item and I is one K step (1
# holds them through the gate/up items too: at the defaults 3 programs an SM then, too few, so none early)
# router_early: each program's first router item's weights loaded before the PDL wait (on since session 57: the
# module docstring has its timings)
TILES = dict(
    bd=64, ks=1, bn_g=4, bk_g=512, bn_d=4, bk_d=256, warps=4, per_sm=4, defer=1, early=2, router_early=1
)
_fits: dict[tuple, int] = {}  # a launch's shapes and constants -> how many of its programs an SM holds


# the points a traced launch stamps (moe_decode_triton(trace=...)), and the spans between them
TRACE_POINTS = ("start", "router done", "barrier 0 passed", "routed", "gate/up done", "barrier 1 passed",
                "down done", "end")  # fmt: skip
TRACE_SPANS = ("router", "barrier 0 wait", "routing", "gate/up items", "barrier 1 wait", "down and combine",
               "exit")  # fmt: skip


def trace_summary(trace: torch.Tensor, programs: int) -> dict:
    """What a traced launch's programs spent between its points: each span's median and largest over the
    programs, in us (the SM clock's cycles over the ns timer's, summed over every program); and when the first
    and the last program reached each point, in us from the first start."""
    t = trace[:programs].detach().cpu().double()
    cycles, ns = t[:, :8], t[:, 8:]
    ghz = ((cycles[:, -1] - cycles[:, 0]).sum() / (ns[:, -1] - ns[:, 0]).sum().clamp(min=1)).item()
    spans = (cycles[:, 1:] - cycles[:, :-1]) / ghz / 1e3  # [programs, 7] us
    start = ns[:, 0].min()
    return {
        "programs": programs,
        "clock_ghz": ghz,
        "spans_us": {
            name: {"median": spans[:, i].median().item(), "max": spans[:, i].max().item()}
            for i, name in enumerate(TRACE_SPANS)
        },
        "reached_us": {
            name: {
                "first": (ns[:, i].min() - start).item() / 1e3,
                "last": (ns[:, i].max() - start).item() / 1e3,
            }
            for i, name in enumerate(TRACE_POINTS)
        },
    }


def _sync_buffer(device: torch.device) -> torch.Tensor:
    """The device's barrier counters: [0] and [1] the two barriers', [2] the programs done, [3] a barrier gave
    up (a grid not all resident). Every launch leaves [0:3] at zero."""
    if device not in _sync:
        _sync[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return _sync[device]


def barrier_gave_up(device: torch.device | str) -> bool:
    """Whether a launch on `device` gave up at a barrier since the last look (sync[3]: a grid not all resident,
    whose results are wrong); its counters are then zeroed, since late programs may have left one raised. False
    where no launch has run. The benchmarks and scripts/served_tokens.py record it."""
    device = torch.device(device)
    gave_up = False
    for dev, sync in _sync.items():
        if dev.type == device.type and device.index in (None, dev.index) and sync[3].item():
            sync.zero_()
            gave_up = True
    return gave_up


@triton.jit
def _grid_sync(sync, k, nprog, MAX_SPIN: tl.constexpr):
    """Wait until all nprog programs have reached barrier k (kestrel.ops.grid_sync); sync[3] says one gave up."""
    grid_wait(sync + k, grid_arrive(sync + k), nprog, sync + 3, MAX_SPIN)


@triton.jit
def _stamp(row, k: tl.constexpr, TRACE: tl.constexpr):
    """With TRACE, this program's SM clock (%clock64) and the GPU's timer in ns (%globaltimer) at point k, into
    row[k] and row[8 + k] (TRACE_POINTS names the points). CUDA only: the interpreter runs no inline PTX."""
    if TRACE:
        cycles = tl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        ns = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        tl.store(row + k, cycles)
        tl.store(row + 8 + k, ns)


@triton.jit
def _route_token(partial, bias, t, S, E, scaling, HAS_BIAS, RENORM, A, BA, BE, BS):
    """Token t's routing from its S partial logits, added in a fixed order (every program gets the same bits):
    (weights [BA] fp32, scaled; ids [BA] int64). Read past L1: other programs wrote them in this launch."""
    cols = tl.arange(0, BE)
    acc = _summed_logits(partial + t * S * BE, S, BE, E, BE, BS, ".cg")
    w_top, id_top = _pick(acc, cols, cols < E, bias, HAS_BIAS, RENORM, A, BA)
    return w_top * scaling, id_top


@triton.jit
def _router_phase(
    x, router_w, partial, pid, nprog, T, D, E, S, w_first, BE: tl.constexpr, BD: tl.constexpr,
    ROUTER_EARLY: tl.constexpr,
):  # fmt: skip
    """The router's partial logits, every expert at once, a slice of D an item: partial[t, s] [BE]. With
    ROUTER_EARLY this program's first item (pid) takes its weights from w_first, loaded before the PDL wait."""
    start = pid
    if ROUTER_EARLY:
        if pid < T * S:
            logits = _slice_dot(x + (pid // S) * D, w_first, pid % S, D, BD)
            tl.store(partial + pid * BE + tl.arange(0, BE), logits)
        start = pid + nprog
    for item in range(start, T * S, nprog):
        logits = _slice_logits(x + (item // S) * D, router_w, item % S, E, D, BE, BD)
        tl.store(partial + item * BE + tl.arange(0, BE), logits)


@triton.jit
def _gate_up_item(
    x, w_e, gu, t, a, n, ks, D, I, beta, linear_beta, SL: tl.constexpr, KS: tl.constexpr, KCH: tl.constexpr,
    BN_G: tl.constexpr, BK_G: tl.constexpr, SITU: tl.constexpr, BF16: tl.constexpr, DEFER: tl.constexpr,
):  # fmt: skip
    """One gate/up item: token t, slot a's expert w_e [2I, D], tile n of I, slice ks of D, into gu[t, a, ks]
    (fp32; with one slice, KS 1, the whole sum: h itself, rounded as the reference, in the gate half)."""
    dt = x.dtype.element_ty
    cols = n * BN_G + tl.arange(0, BN_G)  # [BN_G] units of I
    cmask = cols < I
    if DEFER:  # products added elementwise across the K steps, reduced once at the end
        part_g = tl.zeros([BN_G, BK_G], dtype=tl.float32)
        part_u = tl.zeros([BN_G, BK_G], dtype=tl.float32)
    else:  # each K step reduced as it comes
        acc_g = tl.zeros([BN_G], dtype=tl.float32)
        acc_u = tl.zeros([BN_G], dtype=tl.float32)
    for k0 in tl.static_range(0, KCH, BK_G):  # unrolled: the item's loads all in flight at once
        kk = k0 + tl.arange(0, BK_G)
        ds = ks * KCH + kk
        kmask = (kk < KCH) & (ds < D)
        xv = tl.load(x + t * D + ds, mask=kmask, other=0.0).to(tl.float32)  # [BK_G]
        wmask = cmask[:, None] & kmask[None, :]
        g = tl.load(w_e + cols[:, None].to(tl.int64) * D + ds[None, :], mask=wmask, other=0.0)
        u = tl.load(w_e + (I + cols[:, None]).to(tl.int64) * D + ds[None, :], mask=wmask, other=0.0)
        if DEFER:
            part_g += g.to(tl.float32) * xv[None, :]
            part_u += u.to(tl.float32) * xv[None, :]
        else:
            acc_g += tl.sum(g.to(tl.float32) * xv[None, :], axis=1)
            acc_u += tl.sum(u.to(tl.float32) * xv[None, :], axis=1)
    if DEFER:
        acc_g = tl.sum(part_g, axis=1)
        acc_u = tl.sum(part_u, axis=1)
    row = gu + ((t * SL + a) * KS + ks) * 2 * I  # [2, I]: gate, then up
    if KS == 1:
        h = glu(_rounded(acc_g, dt, BF16), _rounded(acc_u, dt, BF16), beta, linear_beta, SITU)
        tl.store(row + cols, _rounded(h, dt, BF16), mask=cmask)
    else:
        tl.store(row + cols, acc_g, mask=cmask)
        tl.store(row + I + cols, acc_u, mask=cmask)


@triton.jit
def _gate_up_items(
    x, w13, ws13, gu, id_top, t, pid, nprog, D, I, beta, linear_beta, A: tl.constexpr, SL: tl.constexpr,
    BA: tl.constexpr, KS: tl.constexpr, KCH: tl.constexpr, BN_G: tl.constexpr, BK_G: tl.constexpr,
    SITU: tl.constexpr, BF16: tl.constexpr, DEFER: tl.constexpr,
):  # fmt: skip
    """This program's gate/up items (slot, tile of I, slice of D) of token t, routed to the experts id_top."""
    slots = tl.arange(0, BA)
    NG = tl.cdiv(I, BN_G)
    per_token = SL * NG * KS
    first = (pid - (t * per_token) % nprog + nprog) % nprog  # this program's first item of token t
    for j in range(first, per_token, nprog):
        a = j // (NG * KS)
        e = tl.sum(tl.where(slots == a, id_top, 0), axis=0)
        w_e = tl.where(a == A, ws13, w13 + e * 2 * I * D)  # [2I, D]: a == A only with SHARED
        _gate_up_item(
            x, w_e, gu, t, a, (j // KS) % NG, j % KS, D, I, beta, linear_beta, SL, KS, KCH,
            BN_G, BK_G, SITU, BF16, DEFER,
        )  # fmt: skip


@triton.jit
def _gate_up_phase(
    x, bias, w13, ws13, partial, gu, weights_out, ids_out, pid, nprog, T, D, E, I, S, scaling, beta, linear_beta,
    A: tl.constexpr, SL: tl.constexpr, BA: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr, KS: tl.constexpr,
    KCH: tl.constexpr, BN_G: tl.constexpr, BK_G: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    SITU: tl.constexpr, BF16: tl.constexpr, DEFER: tl.constexpr, trace_row,
    TRACE: tl.constexpr,
):  # fmt: skip
    """The gate/up items (token, slot, tile of I, slice of D) after the routing every program computes from the
    partial logits; program 0 stores the routing. (The shared expert's items beside the router's instead, in
    the programs it leaves idle, made the layer slower: 21.5 against 20.4 us, session 39.)"""
    for t in range(0, T):
        w_top, id_top = _route_token(partial, bias, t, S, E, scaling, HAS_BIAS, RENORM, A, BA, BE, BS)
        _store_routing(weights_out, ids_out, w_top, id_top, t, pid, A, BA)
        if t == 0:
            _stamp(trace_row, 3, TRACE)  # the first token routed
        _gate_up_items(
            x, w13, ws13, gu, id_top, t, pid, nprog, D, I, beta, linear_beta, A, SL, BA, KS, KCH, BN_G, BK_G,
            SITU, BF16, DEFER,
        )  # fmt: skip


@triton.jit
def _store_routing(weights_out, ids_out, w_top, id_top, t, pid, A: tl.constexpr, BA: tl.constexpr):
    """Program 0 stores token t's routing (every program computed the same)."""
    slots = tl.arange(0, BA)
    if pid == 0:
        tl.store(weights_out + t * A + slots, w_top, mask=slots < A)
        tl.store(ids_out + t * A + slots, id_top, mask=slots < A)


@triton.jit
def _h_rows(
    gu, rows, rmask, ki, kmask, I: tl.constexpr, KS: tl.constexpr, dt: tl.constexpr, beta, linear_beta,
    SITU: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """h [R, BK] fp32 of the slot rows `rows` [R] (t * SL + slot) over I's columns ki: read as the gate/up
    phase stored it (KS 1), or made from its KS partial sums added in order and rounded as the reference.
    Read past L1: other programs wrote them in this launch."""
    base = gu + rows[:, None] * KS * 2 * I + ki[None, :]
    mask = rmask[:, None] & kmask[None, :]
    if KS == 1:
        return tl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
    g = tl.zeros(base.shape, dtype=tl.float32)
    u = tl.zeros(base.shape, dtype=tl.float32)
    for ks in tl.static_range(KS):
        g += tl.load(base + ks * 2 * I, mask=mask, other=0.0, cache_modifier=".cg")
        u += tl.load(base + ks * 2 * I + I, mask=mask, other=0.0, cache_modifier=".cg")
    h = glu(_rounded(g, dt, BF16), _rounded(u, dt, BF16), beta, linear_beta, SITU)
    return _rounded(h, dt, BF16)


@triton.jit
def _down_tiles(
    w2, ws2, id_top, smask, cols, cmask, ki, kmask, D, I: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
    SHARED: tl.constexpr,
):  # fmt: skip
    """One K step of a down item's weights: every routed slot's tile in one load [BA, BN_D, BK_D] (the experts
    id_top's rows cols, columns ki of I) and the shared expert's [BN_D, BK_D] (zeros without one)."""
    experts = w2 + id_top * D * I  # [BA] each slot's [D, I]
    w = tl.load(
        experts[:, None, None] + cols[None, :, None].to(tl.int64) * I + ki[None, None, :],
        mask=smask[:, None, None] & cmask[None, :, None] & kmask[None, None, :],
        other=0.0,
    )
    if SHARED:
        ws = tl.load(
            ws2 + cols[:, None].to(tl.int64) * I + ki[None, :],
            mask=cmask[:, None] & kmask[None, :],
            other=0.0,
        )
    else:
        ws = tl.zeros([BN_D, BK_D], dtype=w.dtype)
    return w, ws


@triton.jit
def _down_sums(
    w, ws, acc, acc_s, gu, t, ki, kmask, beta, linear_beta, I: tl.constexpr, A: tl.constexpr, SL: tl.constexpr,
    BA: tl.constexpr, KS: tl.constexpr, SITU: tl.constexpr, SHARED: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """One K step's products added into acc [BA, BN_D] (each routed slot's) and acc_s [BN_D] (the shared
    expert's): h of token t's slots at columns ki, read after the weights' loads went out."""
    slots = tl.arange(0, BA)
    smask = slots < A
    dt = w.dtype
    h = _h_rows(gu, t * SL + slots, smask, ki, kmask, I, KS, dt, beta, linear_beta, SITU, BF16)
    acc += tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)
    if SHARED:
        row_s = t * SL + A + tl.arange(0, 1)  # the shared slot's row, as a [1] tensor
        h_s = _h_rows(gu, row_s, row_s >= 0, ki, kmask, I, KS, dt, beta, linear_beta, SITU, BF16)
        acc_s += tl.sum(ws.to(tl.float32) * h_s, axis=1)
    return acc, acc_s


@triton.jit
def _down_store(
    acc, acc_s, w_top, out, t, cols, cmask, D, A: tl.constexpr, BA: tl.constexpr, SHARED: tl.constexpr,
    ACCUMULATE: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Each expert's output rounded, their weighted sum in slot order (as the reference's), the shared expert's
    and the residual added: out[t, cols]."""
    slots = tl.arange(0, BA)
    dt = out.dtype.element_ty
    y = _rounded(acc, dt, BF16)  # [BA, BN_D] each expert's output in x's dtype
    total = tl.zeros(acc_s.shape, dtype=tl.float32)
    for a in tl.static_range(A):  # in slot order (a row picked out exactly: the others add zeros)
        y_a = tl.sum(tl.where(slots[:, None] == a, y, 0.0), axis=0)
        total += tl.sum(tl.where(slots == a, w_top, 0.0), axis=0) * y_a
    if SHARED:
        total = _rounded(total, dt, BF16) + _rounded(acc_s, dt, BF16)
    if ACCUMULATE:
        before = tl.load(out + t * D + cols, mask=cmask, other=0.0).to(tl.float32)
        total = _rounded(total, dt, BF16) + before
    total = _rounded(total, dt, BF16)
    tl.store(out + t * D + cols, total.to(dt), mask=cmask)


@triton.jit
def _down_phase(
    x, w2, ws2, gu, weights_out, ids_out, out, pid, nprog, T, D, I: tl.constexpr, beta, linear_beta,
    A: tl.constexpr, SL: tl.constexpr, BA: tl.constexpr, KS: tl.constexpr, BN_D: tl.constexpr,
    BK_D: tl.constexpr, SITU: tl.constexpr, SHARED: tl.constexpr, ACCUMULATE: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """Down and combine into out: an item is (token, tile of D). Every routed slot's weight tile is one load
    [BA, BN_D, BK_D], issued before h, so an item's loads are all in flight at once (one slot after another,
    each waiting on the last slot's math, took 13.7 us a layer: session 39); the shared expert's beside it.
    Then each expert's output rounded, and the weighted sum in slot order, as the reference's."""
    slots = tl.arange(0, BA)
    smask = slots < A
    ND = tl.cdiv(D, BN_D)
    for t in range(0, T):
        # the routing program 0 stored in the gate_up phase (before the barrier, or the launch before)
        w_top = tl.load(weights_out + t * A + slots, mask=smask, other=0.0, cache_modifier=".cg")
        id_top = tl.load(ids_out + t * A + slots, mask=smask, other=0, cache_modifier=".cg")
        first = (pid - (t * ND) % nprog + nprog) % nprog
        for n in range(first, ND, nprog):
            cols = n * BN_D + tl.arange(0, BN_D)  # [BN_D] output units
            cmask = cols < D
            acc = tl.zeros([BA, BN_D], dtype=tl.float32)
            acc_s = tl.zeros([BN_D], dtype=tl.float32)
            for k0 in tl.static_range(0, I, BK_D):
                ki = k0 + tl.arange(0, BK_D)
                kmask = ki < I
                w, ws = _down_tiles(w2, ws2, id_top, smask, cols, cmask, ki, kmask, D, I, BN_D, BK_D, SHARED)
                acc, acc_s = _down_sums(
                    w, ws, acc, acc_s, gu, t, ki, kmask, beta, linear_beta, I, A, SL, BA, KS, SITU, SHARED, BF16
                )  # fmt: skip
            _down_store(acc, acc_s, w_top, out, t, cols, cmask, D, A, BA, SHARED, ACCUMULATE, BF16)


@triton.jit
def _moe_decode_kernel(
    x,
    router_w,
    bias,
    w13,
    w2,
    ws13,
    ws2,
    partial,
    gu,
    weights_out,
    ids_out,
    out,
    sync,
    T,
    D,
    E,
    I: tl.constexpr,
    S,
    scaling,
    beta,
    linear_beta,
    A: tl.constexpr,
    BA: tl.constexpr,
    BE: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    KS: tl.constexpr,
    KCH: tl.constexpr,
    BN_G: tl.constexpr,
    BK_G: tl.constexpr,
    BN_D: tl.constexpr,
    BK_D: tl.constexpr,
    DEFER: tl.constexpr,
    EARLY: tl.constexpr,
    trace,
    TRACE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    SITU: tl.constexpr,
    SHARED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BF16: tl.constexpr,
    PHASE: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    PDL: tl.constexpr = False,
    ROUTER_EARLY: tl.constexpr = False,
):
    """PHASE 0: all three phases with the grid barriers between them; 1, 2, 3: only the router, gate_up or
    down phase (three launches, no barrier: the CPU interpreter's way). EARLY (PHASE 0 with one token, at most
    one down item a program and one K step of it): each program issues its down item's weight loads once it has
    routed, before its gate/up items (1) or after them (2), and holds them in registers through barrier 1, so
    the down phase after it waits only for h (the same products in the same order: the phased launches' bits).
    ROUTER_EARLY (PHASE 0 or 1): each program's first router item's weights are loaded before the PDL wait (the
    router weight depends on no kernel), so they arrive while the kernel before ends."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    pdl_launch_next(PDL)
    if ROUTER_EARLY and (PHASE == 0 or PHASE == 1):
        # [BE, BD]; a program past the items reads none
        w_first = _slice_weights(router_w, pid % S, tl.where(pid < T * S, E, 0), D, BE, BD)
    else:
        w_first = pid  # not read
    pdl_wait(PDL)
    row = trace + pid * 16  # this program's trace (TRACE only)
    _stamp(row, 0, TRACE)
    SL: tl.constexpr = A + SHARED  # the slots: the routed experts', then the shared expert's
    if PHASE == 0 or PHASE == 1:
        _router_phase(x, router_w, partial, pid, nprog, T, D, E, S, w_first, BE, BD, ROUTER_EARLY)
        _stamp(row, 1, TRACE)
    if PHASE == 0:
        _grid_sync(sync, 0, nprog, MAX_SPIN)
        _stamp(row, 2, TRACE)
    if PHASE == 0 and EARLY > 0:  # one token: this program's down item, its weights held through barrier 1
        w_top, id_top = _route_token(partial, bias, 0, S, E, scaling, HAS_BIAS, RENORM, A, BA, BE, BS)
        _store_routing(weights_out, ids_out, w_top, id_top, 0, pid, A, BA)
        _stamp(row, 3, TRACE)
        smask = tl.arange(0, BA) < A
        cols = pid * BN_D + tl.arange(0, BN_D)  # this program's down item: pid (none past the D / BN_D items)
        cmask = cols < D
        ki = tl.arange(0, BK_D)
        kmask = ki < I
        if EARLY == 1:
            w_dn, ws_dn = _down_tiles(
                w2, ws2, id_top, smask, cols, cmask, ki, kmask, D, I, BN_D, BK_D, SHARED
            )
        _gate_up_items(
            x, w13, ws13, gu, id_top, 0, pid, nprog, D, I, beta, linear_beta, A, SL, BA, KS, KCH, BN_G, BK_G,
            SITU, BF16, DEFER,
        )  # fmt: skip
        if EARLY == 2:
            w_dn, ws_dn = _down_tiles(
                w2, ws2, id_top, smask, cols, cmask, ki, kmask, D, I, BN_D, BK_D, SHARED
            )
    elif PHASE == 0 or PHASE == 2:
        _gate_up_phase(
            x, bias, w13, ws13, partial, gu, weights_out, ids_out, pid, nprog, T, D, E, I, S, scaling, beta,
            linear_beta, A, SL, BA, BE, BS, KS, KCH, BN_G, BK_G, HAS_BIAS, RENORM, SITU, BF16, DEFER, row, TRACE,
        )  # fmt: skip
    if PHASE == 0 or PHASE == 2:
        _stamp(row, 4, TRACE)
    if PHASE == 0:
        _grid_sync(sync, 1, nprog, MAX_SPIN)
        if pid == 0:  # every program has left barrier 0: ready for the next launch
            tl.atomic_xchg(sync, 0, sem="relaxed", scope="gpu")
        _stamp(row, 5, TRACE)
    if PHASE == 0 and EARLY > 0:
        acc = tl.zeros([BA, BN_D], dtype=tl.float32)
        acc_s = tl.zeros([BN_D], dtype=tl.float32)
        acc, acc_s = _down_sums(
            w_dn, ws_dn, acc, acc_s, gu, 0, ki, kmask, beta, linear_beta, I, A, SL, BA, KS, SITU, SHARED, BF16
        )  # fmt: skip
        _down_store(acc, acc_s, w_top, out, 0, cols, cmask, D, A, BA, SHARED, ACCUMULATE, BF16)
    elif PHASE == 0 or PHASE == 3:
        _down_phase(
            x, w2, ws2, gu, weights_out, ids_out, out, pid, nprog, T, D, I, beta, linear_beta,
            A, SL, BA, KS, BN_D, BK_D, SITU, SHARED, ACCUMULATE, BF16,
        )  # fmt: skip
    if PHASE == 0 or PHASE == 3:
        _stamp(row, 6, TRACE)
    if PHASE == 0:  # the last program out leaves the counters at zero
        done = tl.atomic_add(sync + 2, 1, sem="acq_rel", scope="gpu")
        if done == nprog - 1:
            tl.atomic_xchg(sync + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync + 2, 0, sem="relaxed", scope="gpu")
    _stamp(row, 7, TRACE)


def moe_decode_triton(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    programs: int | None = None,
    phased: bool | None = None,
    tiles: dict | None = None,
    phases: tuple[int, ...] = (1, 2, 3),
    scratch: dict | None = None,
    launch: dict | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE layer on x [T, D] in one launch: `route_hidden_triton(x, router_weight, correction_bias, top_k,
    renormalize, scaling_factor)`, then `moe_experts_triton(x, w13, w2, weights, ids, act, situ_beta,
    situ_linear_beta, shared=shared, out=out, accumulate=accumulate)`. w13 [E, 2I, D], w2 [E, D, I] and the
    shared expert's (ws13 [2I, D], ws2 [D, I]) in x's dtype; router_weight [E, D] and correction_bias [E] fp32.
    programs: the grid (None: the SM count times TILES' per_sm; on the CPU 3 times per_sm phased, 1 in one
    launch; never more than there are items);
    phased: three launches instead of one (None: on the CPU only, where one launch takes one program: the
    interpreter runs a program to its end before the next starts); tiles: overrides of TILES.
    phases: when phased, only these of the three (1 router, 2 gate/up and routing, 3 down and combine), to time
    one phase alone (scripts/decode_kernels_check.py); what a phase reads from the others is in scratch.
    scratch: a dict the buffers the phases hand on are kept in between calls (partial logits, gate/up partial
    sums, the routing; filled on first use, for one set of shapes); None: new buffers each call.
    launch: a dict given the grid launched ("programs") and where the down loads went ("early"), for the
    benchmarks.
    trace: int64 [at least the grid, 16] on CUDA, one launch only: each program's clock and timer at the
    TRACE_POINTS (row[k], row[8 + k]; `trace_summary` reads them), for the benchmarks.
    Returns (out [T, D] in x's dtype, weights [T, A] fp32, ids [T, A] int64)."""
    T, D = x.shape
    E, two_i, D13 = w13.shape
    I = two_i // 2
    assert router_weight.shape == (E, D) and D13 == D and w2.shape == (E, D, I), (
        f"router {tuple(router_weight.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, x {tuple(x.shape)}"
    )
    assert w13.dtype == w2.dtype == x.dtype, f"x {x.dtype}, experts {w13.dtype} / {w2.dtype}: one dtype"
    if act not in ("silu", "situ"):
        raise ValueError(f"unknown activation {act!r}")
    if shared is not None:
        ws13, ws2 = (w.contiguous() for w in shared)
        assert ws13.shape == (2 * I, D) and ws2.shape == (D, I) and ws13.dtype == ws2.dtype == x.dtype, (
            f"shared expert {tuple(ws13.shape)}, {tuple(ws2.shape)}: needs the routed experts' width and dtype"
        )
    else:
        ws13, ws2 = w13, w2  # not read
    if out is None:
        assert not accumulate, "accumulate adds into a given out"
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    assert out.shape == (T, D) and out.dtype == x.dtype and out.is_contiguous()
    if phased is None:
        phased = not x.is_cuda
    assert set(phases) <= {1, 2, 3} and (phased or tuple(phases) == (1, 2, 3)), (
        f"phases {phases}: of 1-3, phased"
    )
    bufs = {} if scratch is None else scratch

    def buffer(name: str, *shape: int, dtype=torch.float32) -> torch.Tensor:  # scratch's, or a new one
        if name not in bufs:
            bufs[name] = torch.empty(*shape, dtype=dtype, device=x.device)
        return bufs[name]

    weights, ids = buffer("weights", T, top_k), buffer("ids", T, top_k, dtype=torch.int64)
    if T == 0:
        return out, weights, ids
    x, router_weight = x.contiguous(), router_weight.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    t = TILES | (tiles or {})
    BE, BA = triton.next_power_of_2(E), triton.next_power_of_2(top_k)
    BD = min(t["bd"], triton.next_power_of_2(D))
    S = triton.cdiv(D, BD)
    KS = t["ks"]
    KCH = triton.cdiv(triton.cdiv(D, KS), t["bk_g"]) * t["bk_g"]  # D's slice a gate/up item sums over
    SL = top_k + (shared is not None)
    partial = buffer("partial", T, S, BE)  # [T, S, BE]
    gu = buffer("gu", T, SL, KS, 2, I)  # gate and up, per D slice
    assert partial.shape == (T, S, BE) and gu.shape == (T, SL, KS, 2, I), "scratch of other shapes or tiles"
    items = max(T * S, T * SL * triton.cdiv(I, t["bn_g"]) * KS, T * triton.cdiv(D, t["bn_d"]))  # each phase's
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 3
    if programs is None:  # (one launch on the CPU: one program, below)
        programs = sms * t["per_sm"] if phased or x.is_cuda else 1
    programs = max(1, min(programs, items))
    sync = _sync_buffer(x.device) if not phased else weights  # not read when phased
    bias = correction_bias if correction_bias is not None else router_weight  # unused without HAS_BIAS
    args = (
        x, router_weight, bias, w13, w2, ws13, ws2, partial, gu, weights, ids, out, sync,
        T, D, E, I, S, float(scaling_factor), float(situ_beta), float(situ_linear_beta),
    )  # fmt: skip
    consts = dict(
        A=top_k, BA=BA, BE=BE, BS=min(triton.next_power_of_2(S), max(1, 8192 // BE)), BD=BD, KS=KS, KCH=KCH,
        BN_G=t["bn_g"], BK_G=t["bk_g"], BN_D=t["bn_d"], BK_D=t["bk_d"], DEFER=bool(t["defer"]),
        ROUTER_EARLY=bool(t["router_early"]),
        TRACE=trace is not None,
        HAS_BIAS=correction_bias is not None, RENORM=renormalize, SITU=act == "situ",
        SHARED=shared is not None, ACCUMULATE=accumulate, BF16=x.dtype == torch.bfloat16,
        MAX_SPIN=MAX_SPIN, num_warps=t["warps"], **pdl_args(out),
    )  # fmt: skip
    stamps = trace if trace is not None else sync  # (not read without a trace)
    ND = triton.cdiv(D, t["bn_d"])  # the down items of a token

    def early(programs: int) -> int:
        """The early down loads' mode (TILES' early), where they apply: one token, one down item a program."""
        return t["early"] if not phased and T == 1 and ND <= programs and I <= t["bk_d"] else 0

    assert t["early"] in (0, 1, 2), f"early {t['early']}: 0, 1 or 2"
    consts["EARLY"] = early(programs)
    if not phased and not x.is_cuda:
        # the interpreter runs each program to its end before the next: a barrier opens only with one program
        assert programs == 1, "one launch on the CPU: one program (phased runs any grid)"
    elif not phased:  # the barriers wait for every program: never more than the SMs hold at once

        def fits() -> int:  # the programs the GPU holds at once, read from the compiled kernel
            key = (x.device, x.dtype, T, D, E, I, *consts.items())  # (consts: built in one order)
            if key not in _fits:
                compiled = _moe_decode_kernel.warmup(*args, grid=(programs,), PHASE=0, trace=stamps, **consts)
                _fits[key] = programs_an_sm(compiled, t["warps"], x.device)
            return _fits[key] * sms

        held = fits()
        if consts["EARLY"] and not early(min(programs, held)):
            # the loads held in registers leave room for too few programs: without them
            consts["EARLY"] = 0
            held = fits()
        if held < 1:
            raise RuntimeError(f"moe_decode_triton: tiles {t} need more than one SM holds; use smaller tiles")
        programs = min(programs, held)
    if launch is not None:
        launch.update(programs=programs, early=consts["EARLY"])
    if trace is not None:
        assert x.is_cuda and not phased, "trace: one launch on CUDA (the interpreter runs no inline PTX)"
        assert trace.dtype == torch.int64 and trace.shape[0] >= programs and trace.shape[1] == 16, (
            f"trace {tuple(trace.shape)} {trace.dtype}: int64 [>= {programs}, 16]"
        )
    for phase in phases if phased else (0,):
        _moe_decode_kernel[(programs,)](*args, PHASE=phase, trace=stamps, **consts)
    return out, weights, ids
