"""Kimi Delta Attention (KDA): plain-torch references (model-spec section 1).

Dimension legend: B batch, T tokens, N sequences, H heads, K key dim, V value dim, C conv channels,
W conv width; in the chunked form, NC chunks of L tokens (L = chunk_size).
Layouts follow fla-core: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log-space decay); beta [B, T, H];
recurrent state [N, H, K, V] (K first), fp32. Varlen inputs are packed with B = 1 and `cu_seqlens` [N + 1].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kestrel.utils.fuse import fused


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, except that fp64 inputs stay fp64 (tests check chunk == recurrent tightly in fp64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@fused("kestrel.ops.kda.triton_gate:kda_gate_triton")
def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """Log-space channel-wise decay g (fp32) from the raw forget projection f [..., H, K].

    A_log [H] (per head), dt_bias [H * K].
    lower_bound None (Kimi-Linear): g = -exp(A_log[h]) * softplus(f + dt_bias)
    lower_bound lb (K3, lb < 0):    g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))
    """
    H, K = f.shape[-2:]
    dtype = _compute_dtype(f)
    x = f.to(dtype) + dt_bias.to(dtype).view(H, K)  # [..., H, K]
    a = A_log.to(dtype).reshape(H, 1).exp()  # [H, 1]; reshape also accepts Kimi-Linear's [1, 1, H, 1]
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (fla's convention: + eps, not max)."""
    x = x.to(_compute_dtype(x))
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _sequence_bounds(
    cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None = None
) -> list[tuple[int, int]]:
    """Each packed sequence's (start, end), read from the host copy when the caller has one (no device sync)."""
    starts = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    return list(zip(starts[:-1], starts[1:]))


def as_planes(y: torch.Tensor, planes: int) -> torch.Tensor:
    """y [T, C] as [planes, T, C / planes] (a view: the channel groups, e.g. q | k | v), or y itself for 1."""
    return y if planes == 1 else y.view(y.shape[0], planes, -1).transpose(0, 1)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    planes: int = 1,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of width W followed by SiLU, over packed sequences.

    x [T, C] (packed tokens of N sequences, split by cu_seqlens [N + 1]; None means one sequence),
    weight [C, W], conv_state [N, C, W - 1] the last W - 1 inputs before each sequence (None = zeros).
    y_t[c] = SiLU(sum_j weight[c, j] * window[c, j]) where window = [state | x] ending at t.
    Returns (y [T, C] in x.dtype, new_state [N, C, W - 1] = the last W - 1 inputs of each window, x.dtype).
    A sequence shorter than W - 1 keeps part of its old state in the new state. With planes > 1, y comes as
    [planes, T, C / planes] (`as_planes`; the fast kernel writes each plane contiguous). cu_seqlens_cpu: the
    same offsets on the host, when the caller has them, so the layout is read without a device sync (every
    backend's `chunk` and `short_conv` take it; those that read no layout on the host ignore it).
    """
    T, C = x.shape
    W = weight.shape[-1]
    bounds = [(0, T)] if cu_seqlens is None else _sequence_bounds(cu_seqlens, cu_seqlens_cpu)
    if conv_state is None:
        conv_state = x.new_zeros(len(bounds), C, W - 1)
    assert conv_state.shape == (len(bounds), C, W - 1), f"conv_state {tuple(conv_state.shape)}"
    dtype = _compute_dtype(x)
    w = weight.to(dtype)  # [C, W]

    y = torch.empty_like(x)  # [T, C]
    new_state = torch.empty_like(conv_state, dtype=x.dtype)  # [N, C, W - 1]
    for n, (bos, eos) in enumerate(bounds):
        padded = torch.cat([conv_state[n].to(x.dtype).T, x[bos:eos]])  # [W - 1 + L, C]
        if eos > bos:
            windows = padded.to(dtype).unfold(0, W, 1)  # [L, C, W], window j ends at token bos + j
            y[bos:eos] = F.silu((windows * w).sum(-1)).to(x.dtype)
        new_state[n] = padded[padded.shape[0] - (W - 1) :].T  # [C, W - 1]
    return as_planes(y, planes), new_state


def short_conv_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` for one new token per sequence (decode), batched and free of host syncs.

    x [N, C] (token n belongs to sequence n), weight [C, W], conv_state [N, C, W - 1].
    Returns (y [N, C] in x.dtype, new_state [N, C, W - 1] in conv_state.dtype). Same rounding as
    `short_conv`: the state enters the window in x.dtype.
    """
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [N, C, W]
    dtype = _compute_dtype(x)
    y = F.silu((window.to(dtype) * weight.to(dtype)).sum(-1))  # [N, C]
    return y.to(x.dtype), window[:, :, 1:].to(conv_state.dtype)


def _prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm):
    """Everything in the compute dtype; q, k l2-normalized (optionally) and q scaled."""
    dtype = _compute_dtype(v)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q.to(dtype) * scale
    return q, k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype)


def _over_sequences(
    run: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply `run` (a batch of equal-length sequences, with their states) to the whole batch, or to each
    sequence of a packed batch in turn. Inputs are already in the compute dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    bounds = None if cu_seqlens is None else _sequence_bounds(cu_seqlens, cu_seqlens_cpu)
    N = B if bounds is None else len(bounds)
    if bounds is not None:
        assert B == 1, f"varlen inputs must be packed with B = 1, got B = {B}"
    if initial_state is None:
        state = q.new_zeros(N, H, K, V)  # [N, H, K, V]
    else:
        assert initial_state.shape == (N, H, K, V), f"initial_state {tuple(initial_state.shape)}"
        state = initial_state.to(q.dtype)  # [N, H, K, V]

    if bounds is None:
        return run(q, k, v, g, beta, state)
    o = torch.empty_like(v)  # [1, T, H, V]
    final = torch.empty_like(state)  # [N, H, K, V]
    for n, (bos, eos) in enumerate(bounds):
        tokens = slice(bos, eos)
        o[:, tokens], final[n : n + 1] = run(
            q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens], state[n : n + 1]
        )
    return o, final


def _recurrent(q, k, v, g, beta, S):
    """Model-spec 1.3, one token at a time. q (scaled), k [B, T, H, K]; v [B, T, H, V]; S [B, H, K, V]."""
    o = torch.empty_like(v)  # [B, T, H, V]
    for t in range(q.shape[1]):
        S = S * g[:, t, :, :, None].exp()  # [B, H, K, V]   S' = Diag(exp g_t) S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))  # [B, H, V]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]  # [B, H, K, V]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)  # [B, H, V]
    return o, S


def recurrent_kda(
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
    """Token-by-token KDA recurrence (model-spec 1.3), fp32 inside.

    S' = Diag(exp g_t) S;  u = beta_t (v_t - S'^T k_t);  S = S' + k_t u^T;  o_t = S^T (q_t * scale).
    With use_qk_l2norm, q and k are l2-normalized (eps 1e-6) before scaling. scale defaults to K ** -0.5.
    initial_state [N, H, K, V] (N = B, or the number of sequences under cu_seqlens); None = zeros.
    Returns (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None).
    """
    inputs = _prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    o, final = _over_sequences(_recurrent, *inputs, initial_state, cu_seqlens)
    return o.to(v.dtype), (final if output_final_state else None)


def _chunked(q, k, v, g, beta, S, chunk_size):
    """Model-spec 1.5 over chunks of L = chunk_size tokens. Same arguments as `_recurrent`.

    The last chunk is padded with k = v = q = 0, g = 0, beta = 0: a padded row of the WY system is zero
    and a padded column carries k = 0, so padding changes neither the outputs nor the state.
    """
    B, T, H, K = q.shape
    L = chunk_size
    pad = -T % L
    # [B, T, H, ...] -> [B, H, NC, L, ...]
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).unflatten(1, (-1, L)).movedim(3, 1) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).unflatten(1, (-1, L)).movedim(3, 1)  # [B, H, NC, L]

    eye = torch.eye(L, dtype=torch.bool, device=q.device)  # [L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [L, L]  i >= j
    strict = causal & ~eye  # [L, L]  i > j

    o = torch.empty_like(v)  # [B, H, NC, L, V]
    for c in range(q.shape[2]):
        qc, kc, vc, bc = q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c]  # [B, H, L, K|V], bc [B, H, L]
        G = g[:, :, c].cumsum(-2)  # [B, H, L, K]  cumulative log-decay within the chunk
        # Gamma_ij = exp(G_i - G_j) for i >= j; the exponent is masked first so i < j never overflows.
        log_decay = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, L, L, K]
        decay = log_decay.masked_fill(~causal[:, :, None], float("-inf")).exp()  # [B, H, L, L, K]

        # WY form: (I + Lkk) [Wc | Uc] = Diag(beta) [exp(G) * K | V], solved by forward substitution.
        Lkk = bc[..., None] * torch.einsum("bhid,bhjd,bhijd->bhij", kc, kc, decay)  # [B, H, L, L]
        Lkk = Lkk.masked_fill(~strict, 0) + eye  # [B, H, L, L]  unit lower-triangular
        rhs = bc[..., None] * torch.cat([G.exp() * kc, vc], -1)  # [B, H, L, K + V]
        WU = torch.linalg.solve_triangular(Lkk, rhs, upper=False, unitriangular=True)  # [B, H, L, K + V]
        Wc, Uc = WU[..., :K], WU[..., K:]  # [B, H, L, K], [B, H, L, V]

        Aqk = torch.einsum("bhid,bhjd,bhijd->bhij", qc, kc, decay)  # [B, H, L, L]  (zero above the diagonal)
        v_new = Uc - Wc @ S  # [B, H, L, V]
        o[:, :, c] = (qc * G.exp()) @ S + Aqk @ v_new  # [B, H, L, V]
        G_end = G[:, :, -1:]  # [B, H, 1, K]
        S = G_end.mT.exp() * S + ((G_end - G).exp() * kc).mT @ v_new  # [B, H, K, V]

    o = o.flatten(2, 3).movedim(1, 2)[:, :T]  # [B, T, H, V]
    return o, S


def chunk_kda(
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
    chunk_size: int = 64,
    gate_lower_bound: float | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked (WY / parallel) form of the same recurrence (model-spec 1.5); same arguments and results
    as `recurrent_kda`. T need not be a multiple of chunk_size. Computes in fp32, or fp64 when given fp64.
    gate_lower_bound (the bound lb the gates keep to, g in (lb, 0)) is a hint for fast kernels: the
    reference handles any gate and ignores it. cu_seqlens_cpu: as in `short_conv`."""
    inputs = _prepare_inputs(q, k, v, g, beta, scale, use_qk_l2norm)

    def run(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _chunked(*args, chunk_size)

    o, final = _over_sequences(run, *inputs, initial_state, cu_seqlens, cu_seqlens_cpu)
    return o.to(v.dtype), (final if output_final_state else None)


@fused("kestrel.ops.norm.triton_norm:gated_rms_norm_triton")
def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Output norm-gate (model-spec 1.4): RMSNorm_weight(o) * sigmoid(gate) over the last dim (V), in fp32.
    o, gate [..., V]; weight [V]. Returns o.dtype."""
    dtype = _compute_dtype(o)
    x = o.to(dtype)  # [..., V]
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return (weight.to(dtype) * x * torch.sigmoid(gate.to(dtype))).to(o.dtype)


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
    """`recurrent_kda` for one token per sequence on the slots of `state_pool` [S, H, K, V]: gather, step,
    scatter back. The contract of the fast backend's in-place kernel. Returns o [N, 1, H, V].
    gate = (A_log, dt_bias, lower_bound): g is the raw forget projection, made the decay by `kda_gate` (the fast
    kernel does it inside); beta_logits: beta is before its sigmoid; f_b [H * K, K_f]: g is f_a [N, 1, K_f] and
    the raw forget projection f_a f_b^T (the fast kernel makes it inside, `kestrel.ops.kda.F_B_MAX_ROWS`)."""
    if f_b is not None:  # g is f_a [N, 1, K_f]: the raw forget projection first
        g = torch.nn.functional.linear(g, f_b).view(q.shape)
    if gate is not None:
        g = kda_gate(g, *gate)
    if beta_logits:
        beta = torch.sigmoid(beta.float())
    o, state = recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=state_pool[slots],
        output_final_state=True,
        use_qk_l2norm=use_qk_l2norm,
    )
    state_pool[slots] = state.to(state_pool.dtype)
    return o


def conv_step_inplace(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, planes: int = 1
):
    """`short_conv_step` on the windows of `conv_pool` [S, C, W - 1] at `slots`, advancing them in place.
    Returns y [N, C], or with planes > 1 its channel groups [planes, N, C / planes]."""
    y, window = short_conv_step(x, weight, conv_pool[slots])
    conv_pool[slots] = window.to(conv_pool.dtype)
    return y if planes == 1 else y.view(y.shape[0], planes, -1).transpose(0, 1)
