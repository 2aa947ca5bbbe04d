"""A chain of dependent GEMVs in one persistent launch: issue 4's experiment towards a batch-1 megakernel, slower
than the launches it would replace (measured below). Not on the model's path: `scripts/decode_kernels_check.py
--sections l2_ahead` times it against the GEMV launches the decode step runs (`kestrel.ops.linear.triton_gemv`).

Why: at batch 1 mini's decode step is bound by each kernel's latency, not by its bytes (bench/results/HISTORY.md,
session 52's account: the attention projections' 48 GEMV launches take 11.15 us a layer against 5.04 of weights
at the copy rate, and 10.08 with their weights already in L2). A persistent kernel can ask for the weights of the
stages ahead while the stage in front of it ends, which a launch cannot do beyond the PDL overlap of one kernel.

Legend: S stages, M rows (at most 16), stage s a weight W_s [N_s, K_s]; P programs, all resident at once; BN weight
rows a tile, BK a K step. Stage 0 reads the chain's input [M, K_0]; stage s > 0 reads the first K_s columns of stage
s - 1's output (K_s <= N_{s-1}); each stage writes [M, N_s] rounded once from fp32 sums, as `gemv_triton` does.

Every program walks every stage: its tiles t = pid, pid + P, ... of the stage's N_s / BN (with OWN, first asking L2
for all their rows at once, so the K loop, one step at a time, reads from L2), then it arrives at the
stage's counter (release), asks L2 for its tiles of stage s + 1 + AHEAD (a bulk prefetch a weight row, sm_90+;
weights never depend on the chain), and waits until every program has arrived (acquire) before reading the
stage's output. The counters are zeroed before each launch (a memset: CUDA graphs replay it); a wait past
MAX_SPIN polls (a grid not all resident) gives up and raises the flag `gave_up` reads. Triton's CPU interpreter
runs a program to its end before the next starts, so on the CPU the chain runs with one program.

Measured (session 54, H100, bench/results/2026-12-05-h100-session54.json; us a layer, the launches and the floor in
the same runs): floor 7.13, the 48 GEMV launches 12.8-12.9 (weights in L2: 10.3-10.4); this chain at best 23.4 (16
rows a tile, 4 programs an SM, no L2 requests), one program an SM 31-63 whatever the tile, K step, warps or L2
requests, and the L2 requests (own, ahead) slower in every grid (4 programs an SM: 29.5 with own). The same 48
stages on 8 KB weights cost 4.9 a layer at 1, 2 and 4 programs an SM: 2.45 us a dependent stage (an arrival, the
polls and the next stage's first reads, a few L2 round trips), against the ~2.9 us a GEMV launch adds to its bytes
(12.85 / 2 - 3.56). So even with its GEMVs at their bytes' time a chain of counters would save at most ~1 us a
layer: a persistent kernel only pays off by putting more work between its waits, not by replacing each launch
with a wait. Neither this K loop nor `gemv_triton`'s is software-pipelined by Triton (no cp.async in their sm_90
PTX); the launches keep loads in flight with many programs an SM.

The weights live in one flat buffer (`GemvChain` packs them; a megakernel would pack a model's at load), the
activations in another, each stage's place in a table of offsets (`meta`), so one launch addresses any number of
stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.grid_sync import grid_arrive, grid_wait
from kestrel.ops.occupancy import programs_an_sm
from kestrel.ops.pdl import l2_prefetch, pdl_on

MAX_SPIN = 1 << 22  # polls of a counter before a program gives up (~1 us each)
# a stage's entries in the table: weight offset, input offset, input row stride, output offset, N, K
META = tl.constexpr(6)


@triton.jit
def _prefetch_stage(w, meta, s, pid, nprog, BN: tl.constexpr, ELEM: tl.constexpr):
    """Ask L2 for this program's weight rows of stage s (each row K * ELEM bytes, one bulk prefetch)."""
    w_off = tl.load(meta + s * META)
    N = tl.load(meta + s * META + 4)
    K = tl.load(meta + s * META + 5)
    for t in range(pid, tl.cdiv(N, BN), nprog):
        rows = tl.minimum(t * BN + tl.arange(0, BN), N - 1).to(tl.int64)
        l2_prefetch(w + w_off + rows * K, (K * ELEM).to(tl.int32))


@triton.jit
def _chain_kernel(
    w, acts, meta, sync, M, S, nprog,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, AHEAD: tl.constexpr, OWN: tl.constexpr,
    ELEM: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, MAX_SPIN: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m = tl.arange(0, BM)
    mmask = m < M
    if AHEAD > 0:  # the first stages' rows: the stages after stage 0, up to AHEAD of them
        for s in range(1, tl.minimum(S, 1 + AHEAD)):
            _prefetch_stage(w, meta, s, pid, nprog, BN, ELEM)
    for s in range(0, S):
        w_off = tl.load(meta + s * META)
        in_off = tl.load(meta + s * META + 1)
        in_stride = tl.load(meta + s * META + 2)
        out_off = tl.load(meta + s * META + 3)
        N = tl.load(meta + s * META + 4)
        K = tl.load(meta + s * META + 5)
        if OWN:  # all of this stage's rows asked at once: the K loop below then reads them from L2
            _prefetch_stage(w, meta, s, pid, nprog, BN, ELEM)
        for t in range(pid, tl.cdiv(N, BN), nprog):
            cols = t * BN + tl.arange(0, BN)
            nmask = cols < N
            w_rows = w + w_off + cols[:, None].to(tl.int64) * K
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < K
                xt = tl.load(
                    acts + in_off + m[:, None] * in_stride + ks[None, :],
                    mask=mmask[:, None] & kmask[None, :],
                    other=0.0,
                )
                wt = tl.load(w_rows + ks[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                if DOT_F32:
                    xt, wt = xt.to(tl.float32), wt.to(tl.float32)
                acc = tl.dot(xt, tl.trans(wt), acc=acc, input_precision=PRECISION)
            tl.store(
                acts + out_off + m[:, None] * N + cols[None, :],
                acc.to(acts.dtype.element_ty),
                mask=mmask[:, None] & nmask[None, :],
            )
        if s + 1 < S:
            arrived = grid_arrive(sync + s)
            if AHEAD > 0:
                if s + 1 + AHEAD < S:  # the weights AHEAD stages past the next, asked while the others finish
                    _prefetch_stage(w, meta, s + 1 + AHEAD, pid, nprog, BN, ELEM)
            grid_wait(sync + s, arrived, nprog, sync + S, MAX_SPIN)


class GemvChain:
    """Stages of GEMVs chained (module docstring) over static buffers: fill `input` [M, K_0], call, read `outputs`
    (each stage's [M, N_s], views of one buffer, rewritten by each call). The weights are copied into one flat
    buffer. block_n rows a tile, block_k a K step, ahead the stages whose weights a program asks L2 for past the
    next one (0: none; CUDA sm_90+ only), own whether a program asks L2 for all its rows of a stage before it
    reads them (as `gemv_triton` does before its PDL wait; CUDA sm_90+ only), programs the grid (None: one a
    streaming multiprocessor, each must be resident at once; on the CPU one)."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        rows: int = 1,
        *,
        block_n: int = 32,
        block_k: int = 256,
        ahead: int = 0,
        own: bool = False,
        programs: int | None = None,
        num_warps: int = 4,
        num_stages: int = 4,
    ):
        assert weights and all(w.dim() == 2 for w in weights), "weights: [N_s, K_s] each"
        assert len({(w.dtype, w.device) for w in weights}) == 1, "one dtype and device for every weight"
        assert 0 < rows <= 16, f"{rows} rows: the chain takes 1 to 16"
        for prev, w in zip(weights, weights[1:]):
            assert w.shape[1] <= prev.shape[0], (
                f"stage of width {w.shape[1]} after one of {prev.shape[0]} outputs: it reads its first K columns"
            )
        first = weights[0]
        self.device, self.dtype, self.rows = first.device, first.dtype, rows
        self.w, self.acts, self.meta, self.input, self.outputs = pack_chain(weights, rows)
        self.sync = torch.zeros(len(weights) + 1, dtype=torch.int32, device=self.device)  # [S]: gave up
        self.stages = len(weights)
        cuda = self.device.type == "cuda"
        dot_f32 = self.dtype == torch.float32 or not cuda  # the CPU interpreter's tl.dot misreads bf16
        row_bytes = {w.shape[1] * w.element_size() for w in weights}
        aligned = all(b % 16 == 0 for b in row_bytes)  # bulk prefetches: 16-byte sizes and addresses
        self.consts = dict(
            BM=16, BN=block_n, BK=min(block_k, max(16, triton.next_power_of_2(max(w.shape[1] for w in weights)))),
            AHEAD=ahead if pdl_on(self.device) and aligned else 0, OWN=own and pdl_on(self.device) and aligned,
            ELEM=first.element_size(), DOT_F32=dot_f32,
            PRECISION="ieee" if dot_f32 else "tf32", MAX_SPIN=MAX_SPIN, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        if not cuda:
            assert programs in (None, 1), "on the CPU the chain runs with one program (module docstring)"
            self.programs = 1
        else:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            args = (self.w, self.acts, self.meta, self.sync, rows, self.stages, 1)
            compiled = _chain_kernel.warmup(*args, grid=(1,), **self.consts)
            held = programs_an_sm(compiled, num_warps, self.device) * sms
            self.programs = programs or sms
            if self.programs > held:
                raise ValueError(f"GemvChain: {self.programs} programs, but the GPU holds {held} at once")

    def __call__(self) -> torch.Tensor:
        """Run every stage; the last stage's output."""
        self.sync.zero_()
        _chain_kernel[(self.programs,)](
            self.w, self.acts, self.meta, self.sync, self.rows, self.stages, self.programs, **self.consts
        )
        return self.outputs[-1]

    def gave_up(self) -> bool:
        """Whether a program gave up waiting at a counter in the last call (its results are wrong)."""
        return bool(self.sync[self.stages].item())


def pack_chain(weights: list[torch.Tensor], rows: int, align: int = 1) -> tuple:
    """A chain's buffers (module docstring): (the weights flat, the activations zeroed, meta [S, META] int64,
    `input` [rows, K_0], each stage's output [rows, N_s], views of the activations). Each output starts at a
    multiple of `align` elements (the CUDA chain reads its input in 16-byte units)."""

    def aligned(n: int) -> int:
        return -(-n // align) * align

    first = weights[0]
    w_flat = torch.cat([w.reshape(-1) for w in weights])
    width = aligned(rows * first.shape[1]) + sum(aligned(rows * w.shape[0]) for w in weights)
    acts = torch.zeros(width, dtype=first.dtype, device=first.device)
    meta, w_off, in_off, in_stride, out_off = [], 0, 0, first.shape[1], aligned(rows * first.shape[1])
    outputs = []
    for w in weights:
        N, K = w.shape
        meta.append([w_off, in_off, in_stride, out_off, N, K])
        outputs.append(acts[out_off : out_off + rows * N].view(rows, N))
        w_off, in_off, in_stride, out_off = w_off + N * K, out_off, N, out_off + aligned(rows * N)
    input_ = acts[: rows * first.shape[1]].view(rows, first.shape[1])
    return w_flat, acts, torch.tensor(meta, dtype=torch.int64, device=first.device), input_, outputs


def gemv_chain_reference(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each stage's output, as the chain computes it: fp32 sums of x's dtype operands, rounded once a stage, the
    next stage reading the first K columns."""
    outs, h = [], x
    for w in weights:
        h = (h[:, : w.shape[1]].float() @ w.float().T).to(x.dtype)
        outs.append(h)
    return outs
