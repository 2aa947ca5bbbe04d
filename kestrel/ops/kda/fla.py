"""KDA on CUDA through fla-core 0.6.0's Triton kernels (model-spec 1.6).

Same signatures and results as the references in `naive.py` (`chunk` = `chunk_kda` without chunk_size,
`recurrent` = `recurrent_kda`). Imported only when the fla backend is selected. We hand fla a precomputed
log-space g and a post-sigmoid beta, and keep its default K-first state layout [N, H, K, V].
"""

from __future__ import annotations

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

from kestrel.env import env_field
from kestrel.ops.kda.naive import as_planes

CHUNK = 64  # fla's chunk size for KDA and its varlen conv (their defaults)
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _warm_chunk_index(*args, **kwargs) -> None:
    """fla-core 0.6.0 indexes the chunks of packed sequences (`prepare_chunk_indices`) from cu_seqlens_cpu on
    the host, then moves the index to the GPU with a blocking copy from pageable memory, which waits for all
    the work queued on the stream: in `chunk_kda` and again in `causal_conv1d`, every forward, and so the host
    could never queue a training step ahead of the GPU. The function keeps its last results by argument
    identity, so this makes the caller's very call (the same objects, in the same positional / keyword form)
    first on a side stream, where the copy waits for nothing else; fla's own call then finds it. The index is
    the same either way: only where the host waits changes. (A later fla that calls it otherwise only brings
    the wait back.)"""
    from fla.ops.utils import prepare_chunk_indices

    device = (kwargs.get("cu_seqlens") if "cu_seqlens" in kwargs else args[0]).device
    if device.type != "cuda":
        return
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(side):
        index = prepare_chunk_indices(*args, **kwargs)
    index.record_stream(main)  # used by the main stream's kernels: not reused before they are done


def chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    disable_recompute: bool | None = None,
    gate_lower_bound: float | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked prefill and training (fla `chunk_kda`, chunk size 64).
    disable_recompute keeps the forward's intermediates for the backward instead of recomputing them, which
    fla recommends for small models (default: KESTREL_KDA_NO_RECOMPUTE, when autograd records).
    gate_lower_bound: the bound lb < 0 the caller's gates keep to (g in (lb, 0), K3's gate); with lb >= -5 and
    KESTREL_KDA_SAFE_GATE on, fla's faster kernels for bounded gates run in training.
    cu_seqlens_cpu: the offsets' host copy: fla's chunk index is then built on the host and moved on a side
    stream (`_warm_chunk_index`), so the call does not wait for the work queued before it.
    At inference, at most KESTREL_KDA_RECURRENT_PREFILL tokens in all run `recurrent` instead: the same result
    in one launch, where the chunked form's ten launches would cost the host more than the GPU's work. (Which
    form runs depends on the step's total tokens, so a sequence's rounding can depend on its batch.)
    Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None)."""
    inputs = (q, k, v, g, beta) if initial_state is None else (q, k, v, g, beta, initial_state)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if not grad and q.shape[0] * q.shape[1] <= env_field("kda_recurrent_prefill"):
        return recurrent(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens
        )
    bounded = gate_lower_bound is not None and -5 <= gate_lower_bound < 0
    safe_gate = env_field("kda_safe_gate") and bounded and grad  # training only: see env.py
    if disable_recompute is None:
        disable_recompute = env_field("kda_no_recompute") and grad
    if initial_state is not None:
        initial_state = initial_state.float()  # chunk_kda asserts an fp32 initial state
    if cu_seqlens is not None and cu_seqlens_cpu is not None:  # chunk_kda's own call, by keyword
        _warm_chunk_index(cu_seqlens=cu_seqlens, chunk_size=CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    o, final_state = chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        disable_recompute=disable_recompute,
        safe_gate=safe_gate,
    )
    return o.to(v.dtype), final_state  # fla returns o in q.dtype


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token decode (fla `fused_recurrent_kda`, forward only). Same results as `chunk`.

    The kernel reads any initial-state dtype (as fp32) and writes a fresh fp32 final state; it never
    updates initial_state in place.
    """
    o, final_state = fused_recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
    )
    return o.to(v.dtype), final_state


def recurrent_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    gate: tuple | None = None,
    beta_logits: bool = False,
    f_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode on the state slots themselves: q, k [N, 1, H, K], v [N, 1, H, V], g [N, 1, H, K], beta [N, 1, H];
    state_pool [S, H, K, V] fp32; the state of sequence n is read from and written back to slot slots[n]
    (fla's continuous-batching mode). Returns o [N, 1, H, V] in v.dtype.
    gate = (A_log [H], dt_bias [H * K], lower_bound or None): g is the raw forget projection and the kernel
    makes the decay itself (`naive.kda_gate`'s formula); beta_logits: the kernel applies beta's sigmoid. Each
    saves the launch of an elementwise kernel a layer. f_b: g is f_a, projected here first (`naive`'s contract)."""
    if f_b is not None:  # g is f_a [N, 1, K_f]: the raw forget projection first
        g = torch.nn.functional.linear(g, f_b).view(q.shape)
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    # the internal entry point indexes raw pointers: it needs contiguous inputs (the public one copies)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    A_log, dt_bias, lower_bound = gate if gate is not None else (None, None, None)
    o, _ = fused_recurrent_kda_fwd(
        q,
        k,
        v,
        g,
        beta,
        A_log=A_log,
        dt_bias=dt_bias,
        initial_state=state_pool,
        scale=scale,
        inplace_final_state=True,
        ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        use_gate_in_kernel=gate is not None,
        use_beta_sigmoid_in_kernel=beta_logits,
        lower_bound=lower_bound,
    )
    return o.to(v.dtype)


def conv_step_inplace(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, planes: int = 1
):
    from kestrel.ops.kda.triton_conv import conv_step_inplace as kernel

    return kernel(x, weight, conv_pool, slots, planes)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    planes: int = 1,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive.short_conv` through fla-core's varlen `causal_conv1d` (SiLU fused, Triton forward and backward).
    fla keeps W inputs of state per sequence, the newest last, and reads only the last W - 1 of them: ours
    [N, C, W - 1] is its [N, C, W] without the first column. With cu_seqlens_cpu (the offsets' host copy) its
    chunk index is built on the host and moved on a side stream, as in `chunk`."""
    from fla.modules.causal_conv1d import causal_conv1d

    x = x.contiguous()  # (q|k|v may be a column slice of the layer's merged input projection)
    T, C = x.shape
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], device=x.device)
    N = cu_seqlens.numel() - 1
    cu_seqlens = cu_seqlens.to(torch.int64)
    if cu_seqlens_cpu is not None:  # causal_conv1d's own call: offsets and chunk size by position
        _warm_chunk_index(cu_seqlens, CHUNK, cu_seqlens_cpu=cu_seqlens_cpu)
    initial = None
    if conv_state is not None:
        initial = torch.cat([conv_state.new_zeros(N, C, 1), conv_state], dim=-1).to(x.dtype)  # [N, C, W]
    y, final = causal_conv1d(
        x[None],
        weight=weight,
        initial_state=initial,
        output_final_state=True,
        activation="silu",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return as_planes(y[0], planes), final[..., 1:].to(x.dtype)
