"""AttnRes mixing in one Triton kernel: `naive.attnres_mix` (fp32 math, result in the sources' dtype) for
inference on CUDA. Eager PyTorch runs the reference as about a dozen kernels over [S, T, D]; here one program
per token reads its S source rows twice (once for the softmax's max and sum, once for the weighted sum).

Legend: S sources, T tokens, D hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix_kernel(
    src_ptr, q_ptr, w_ptr, ow_ptr, out_ptr, T, D, stride_s, stride_t, eps, out_eps,
    S: tl.constexpr, NORM: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    q = tl.load(q_ptr + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(
        w_ptr + cols, mask=mask, other=0.0
    ).to(tl.float32)  # [BD] the norm weight folded into the query
    m = float("-inf")
    den = 0.0
    for s in tl.static_range(S):  # online softmax over the sources' logits
        r = tl.load(src_ptr + s * stride_s + t * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
        e = tl.sum(r * q, axis=0) * tl.rsqrt(tl.sum(r * r, axis=0) / D + eps)
        m_new = tl.maximum(m, e)
        den = den * tl.exp(m - m_new) + tl.exp(e - m_new)
        m = m_new
    acc = tl.zeros([BD], dtype=tl.float32)
    for s in tl.static_range(S):
        r = tl.load(src_ptr + s * stride_s + t * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
        e = tl.sum(r * q, axis=0) * tl.rsqrt(tl.sum(r * r, axis=0) / D + eps)
        acc += tl.exp(e - m) / den * r
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
) -> torch.Tensor:
    """`naive.attnres_mix_norm`: the mix and the consumer's RMSNorm (out_weight [D]) in the same pass."""
    assert out_weight.numel() == sources.shape[-1], f"out_weight {out_weight.numel()}, D {sources.shape[-1]}"
    return _mix(sources, query, norm_weight, eps, out_weight, out_eps)


def _mix(sources, query, norm_weight, eps, out_weight, out_eps) -> torch.Tensor:
    S, T, D = sources.shape
    assert query.numel() == D and norm_weight.numel() == D, (
        f"query {query.numel()}, weight {norm_weight.numel()}, D {D}"
    )
    if sources.stride(-1) != 1:
        sources = sources.contiguous()
    out = torch.empty(T, D, dtype=sources.dtype, device=sources.device)
    if T:
        BD = triton.next_power_of_2(D)
        _mix_kernel[(T,)](
            sources,
            query.reshape(-1),
            norm_weight,
            out_weight if out_weight is not None else norm_weight,  # (not read without NORM)
            out,
            T,
            D,
            sources.stride(0),
            sources.stride(1),
            float(eps),
            float(out_eps),
            S=S,
            NORM=out_weight is not None,
            BD=BD,
            num_warps=min(16, max(1, BD // 256)),
        )
    return out
