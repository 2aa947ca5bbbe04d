"""AttnRes mixing in one Triton kernel: `naive.attnres_mix` (fp32 math, result in the sources' dtype) for
inference on CUDA. Eager PyTorch runs the reference as about a dozen kernels over [S, T, D]; here one program
per token reads its S source rows once, all together, and keeps them in registers (S, padded to a power of two,
times D fp32 values a program: 8 x 2048 over 8 warps on `mini`, 64 values a thread). On the H200 (session 22,
48 calls in a CUDA graph, us a call, 2048 wide, 5 sources): 2.8 at one token, 4.0 at 256 (1.5 us of bytes);
16 warps took 5.4 and 9.1.

Legend: S sources, T tokens, D hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.ops.pdl import pdl_args, pdl_begin


@triton.jit
def _mix_kernel(
    src_ptr, last_ptr, q_ptr, w_ptr, ow_ptr, out_ptr, T, D, stride_s, stride_t, stride_last, eps, out_eps,
    S: tl.constexpr, SP: tl.constexpr, NORM: tl.constexpr, LAST: tl.constexpr, BD: tl.constexpr,
    UPDATE: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program t: token t's S source rows in one [SP, BD] load (all in flight at once: at decode a program's
    time is its loads' latency, and a row at a time paid it S times), their logits, the softmax and the
    weighted sum from registers. With LAST, source S - 1 is read from `last_ptr` [T, D] (its own tensor, not a
    row of `src_ptr`). With UPDATE 1 / 2, row t of `last_ptr` is added to / copied over source S - 1 first,
    rounded to the sources' dtype as torch's add_ / copy_ leave it, and stored back there (program t owns row
    t)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    ss = tl.arange(0, SP)
    live = ss < S
    q = tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
        w_ptr + cols, mask=mask, other=0.0
    ).to(tl.float32)  # [BD] the norm weight folded into the query
    in_src = (ss < S - 1) if LAST else live
    r = tl.load(
        src_ptr + ss[:, None].to(tl.int64) * stride_s + t * stride_t + cols[None, :],
        mask=in_src[:, None] & mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [SP, BD] the sources (rows past S: zeros)
    if LAST:
        row = tl.load(last_ptr + t * stride_last + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
        r = tl.where((ss == S - 1)[:, None], row[None, :], r)
    if UPDATE:
        is_last = (ss == S - 1)[:, None]
        row = tl.load(last_ptr + t * stride_last + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
        if UPDATE == 1:
            row += tl.sum(tl.where(is_last, r, 0.0), axis=0)  # the running sum plus the sublayer's output
        row = row.to(src_ptr.dtype.element_ty)
        tl.store(src_ptr + (S - 1) * stride_s + t * stride_t + cols, row, mask=mask)
        r = tl.where(is_last, row.to(tl.float32)[None, :], r)
    e = tl.sum(r * q[None, :], axis=1) * tl.rsqrt(tl.sum(r * r, axis=1) / D + eps)  # [SP] logits
    e = tl.where(live, e, float("-inf"))
    p = tl.exp(e - tl.max(e, axis=0))  # [SP]
    p = p / tl.sum(p, axis=0)
    acc = tl.sum(p[:, None] * r, axis=0)  # [BD]
    if (
        NORM
    ):  # the consumer's RMSNorm of the mix rounded to the output dtype, as the two ops in a row compute it
        x = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + out_eps)
        acc = tl.load(ow_ptr + cols, mask=mask, other=0.0).to(tl.float32) * (x * inv)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def attnres_mix_triton(
    sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """sources [S, T, D] (the last dim contiguous), query [D], norm_weight [D] -> [T, D] in sources.dtype."""
    return _mix(sources, query, norm_weight, eps, None, 0.0)


def attnres_mix_norm_triton(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
    last: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    accumulate: bool = True,
) -> torch.Tensor:
    """`naive.attnres_mix_norm`: the mix and the consumer's RMSNorm (out_weight [D]) in the same pass; `last`
    [T, D] read in place as the source after `sources`; `update` [T, D] added to (`accumulate`) or copied over
    the last source, in place, as the sources are read."""
    assert out_weight.numel() == sources.shape[-1], f"out_weight {out_weight.numel()}, D {sources.shape[-1]}"
    if update is not None:
        assert last is None, "update goes into the last of `sources`: not with `last`"
        return _mix(sources, query, norm_weight, eps, out_weight, out_eps, update, 1 if accumulate else 2)
    return _mix(sources, query, norm_weight, eps, out_weight, out_eps, last)


def _mix(
    sources,
    query,
    norm_weight,
    eps,
    out_weight,
    out_eps,
    last=None,
    update: int = 0,
    num_warps: int | None = None,
) -> torch.Tensor:
    """With update 1 / 2, `last` goes into the last source (added / copied) instead of being one more."""
    S, T, D = sources.shape
    assert query.numel() == D and norm_weight.numel() == D, (
        f"query {query.numel()}, weight {norm_weight.numel()}, D {D}"
    )
    if update:  # written in place: the sources must be the caller's own memory
        assert sources.stride(-1) == 1, "sources updated in place need a unit last stride"
    elif sources.stride(-1) != 1:
        sources = sources.contiguous()
    if last is not None:
        assert last.shape == (T, D) and last.dtype == sources.dtype, (
            f"last {tuple(last.shape)} {last.dtype}, sources {tuple(sources.shape)} {sources.dtype}"
        )
        last = last if last.stride(-1) == 1 else last.contiguous()
        S += not update
    out = torch.empty(T, D, dtype=sources.dtype, device=sources.device)
    if T:
        BD, SP = triton.next_power_of_2(D), triton.next_power_of_2(S)
        _mix_kernel[(T,)](
            sources,
            last if last is not None else sources,  # (not read without LAST)
            query.reshape(-1),
            norm_weight,
            out_weight if out_weight is not None else norm_weight,  # (not read without NORM)
            out,
            T,
            D,
            sources.stride(0),
            sources.stride(1),
            last.stride(0) if last is not None else 0,
            float(eps),
            float(out_eps),
            S=S,
            SP=SP,
            NORM=out_weight is not None,
            LAST=last is not None and not update,
            BD=BD,
            UPDATE=update,
            # 8 warps: 64 values a thread at 8 x 2048; twice the warps past that (128 a thread up to 16 x 4096;
            # wider tiles spill registers: still right, slower)
            num_warps=num_warps or (16 if SP * BD > 16384 else min(8, max(1, BD // 256))),
            **pdl_args(out),
        )
    return out
