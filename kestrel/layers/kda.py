"""Kimi Delta Attention layer (model-spec 1): projections, short conv, channel-wise gate, delta rule, norm-gate.

Legend: T packed tokens, N sequences, H heads (local to this rank), K = V head dim, P = H * K, W conv width.
The recurrence runs through the KDA backend registry: fla-core on CUDA, the plain-torch reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.layers.context import get_forward_context
from kestrel.layers.linear import ColumnLinear, RowLinear, ShapeMismatch, copy_checked, set_loader
from kestrel.layers.norm import RMSNorm
from kestrel.ops.kda import F_B_MAX_ROWS, gated_rms_norm, get_kda_backend, kda_gate
from kestrel.ops.linear import fused_gemv_applies, linear_conv, linear_gated
from kestrel.utils.dist import parallel_state

QKV = ("q", "k", "v")
# The projections that read the layer input are one matmul (`in_proj`, shards q | k | v | f_a | b | g or g_a);
# checkpoints keep them apart (q_proj, ..., f_a_proj, b_proj, g_proj or g_a_proj): kestrel.models.weights.


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        ps = parallel_state()
        if config.kda_num_heads % ps.tp_size:
            raise ValueError(f"KDA heads {config.kda_num_heads} not divisible by tp_size={ps.tp_size}")
        self.layer_id = layer_id
        self.num_heads = config.kda_num_heads // ps.tp_size
        self.head_dim = config.kda_head_dim
        self.proj_dim = self.num_heads * self.head_dim  # local P
        self.conv_size = config.kda_conv_size
        self.lower_bound = config.kda_gate_lower_bound
        self.eps = config.rms_norm_eps
        D, P, K = config.hidden_size, config.kda_proj_dim, config.kda_head_dim

        # q | k | v | f_a | b | g (or g_a): one matmul over x; f_a and g_a (low-rank bottlenecks) every
        # tensor-parallel rank holds whole, the rest are split by heads
        self.full_rank_gate = config.kda_full_rank_gate
        gate = ("g", P) if config.kda_full_rank_gate else ("g_a", K)
        self.in_proj = ColumnLinear(
            D,
            dtype=dtype,
            output_sizes=[P, P, P, K, config.kda_num_heads, gate[1]],
            shard_names=[*QKV, "f_a", "b", gate[0]],
            replicated=("f_a",) if config.kda_full_rank_gate else ("f_a", "g_a"),
        )
        sizes = self.in_proj.local_sizes
        self.in_split = [sum(sizes[:3]), *sizes[3:]]  # q|k|v, f_a, b, gate
        # Depthwise conv over q|k|v channels, [3P_local, W]; checkpoints store [P, 1, W] per q, k, v.
        self.conv_weight = set_loader(
            nn.Parameter(torch.empty(3 * self.proj_dim, self.conv_size, dtype=dtype)), self._load_conv, QKV
        )
        self.f_b_proj = ColumnLinear(K, P, dtype=dtype)
        if not config.kda_full_rank_gate:
            self.g_b_proj = ColumnLinear(K, P, dtype=dtype)
        self.A_log = set_loader(
            nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)), self._load_a_log
        )
        self.dt_bias = set_loader(
            nn.Parameter(torch.empty(self.proj_dim, dtype=torch.float32)), self._load_head_sharded
        )
        self.o_norm = RMSNorm(K, config.rms_norm_eps, dtype=dtype)  # shared by all heads
        self.o_proj = RowLinear(P, D, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, D]
        ctx = get_forward_context()
        T, H, K = x.shape[0], self.num_heads, self.head_dim
        cache, backend = ctx.cache, get_kda_backend(x.device)
        decode = cache is not None and ctx.decode
        if decode:
            # Decode: one token per sequence, laid out as N sequences of length 1; the conv windows and the
            # recurrent states advance in their slots (no gather/scatter, no host syncs: CUDA-graph safe).
            ssm_pool, conv_pool, slots = cache.kda_pools(self.layer_id)
        planes = None
        if decode and backend.name == "fla" and fused_gemv_applies("conv", x, self.in_proj.weight):
            # the fast backend's conv step (triton_conv's math) inside the projection's GEMV: q, k, v planes
            # [3, N, P] and the windows advanced
            proj, planes = linear_conv(x, self.in_proj.weight, self.conv_weight, conv_pool, slots, planes=3)
        else:
            proj = self.in_proj(x)
        # [T, 3P], [T, K], [T, H], [T, P or K] (the output gate): views of one matmul's rows
        qkv, f_a, b, gate = proj.split(self.in_split, dim=-1)

        if decode:
            if planes is None:
                # q, k, v come out as planes [3, N, P], each contiguous: the recurrence needs no copies of them
                planes = backend.conv_step_inplace(qkv, self.conv_weight, conv_pool, slots, planes=3)
            q, k, v = (t.reshape(T, 1, H, K) for t in planes)
            # the decay gate and beta's sigmoid are computed inside the recurrence's kernel; for a few
            # sequences (up to F_B_MAX_ROWS) the raw forget projection too, from f_b's weight: no launch of its own
            fold = T <= F_B_MAX_ROWS
            f = f_a.unsqueeze(1) if fold else self.f_b_proj(f_a).view(T, 1, H, K)
            o = backend.recurrent_inplace(
                q,
                k,
                v,
                f,
                b.reshape(T, 1, H),
                ssm_pool,
                slots,
                use_qk_l2norm=True,
                gate=(self.A_log, self.dt_bias, self.lower_bound),
                beta_logits=True,
                f_b=self.f_b_proj.weight if fold else None,
            )
        else:
            # Prefill / training: packed varlen sequences (B = 1), states read from and written to the cache.
            f = self.f_b_proj(f_a)  # [T, P] the raw forget projection
            beta = torch.sigmoid(b.float())  # [T, H]
            ssm, conv = cache.kda_state(self.layer_id) if cache is not None else (None, None)
            cu_seqlens, N = ctx.cu_seqlens, ctx.cu_seqlens.numel() - 1
            saves = cache.kda_saves() if cache is not None else None
            host_cu = ctx.host_cu_seqlens() if saves is None else None  # lets fla index chunks without a sync
            if saves is not None:
                # Checkpoints inside the chunk: each is one more segment, a copy of its sequence's first tokens
                # from the same initial state, whose final state is the state at the checkpoint (Tx tokens).
                qkv, f, beta = (torch.cat([t, t[saves.rows]]) for t in (qkv, f, beta))
                ssm, conv = torch.cat([ssm, ssm[saves.seqs]]), torch.cat([conv, conv[saves.seqs]])
                cu_seqlens = saves.cu_seqlens
            Tx = qkv.shape[0]
            # q, k, v as planes [3, Tx, P] (each contiguous from the Triton kernel: the chunked kernels copy none)
            planes, conv_out = backend.short_conv(
                qkv, self.conv_weight, conv, cu_seqlens, planes=3, cu_seqlens_cpu=host_cu
            )  # [3, Tx, P], [N (+ X), 3P, W-1]
            q, k, v = (t.reshape(1, Tx, H, K) for t in planes)
            g = kda_gate(f.view(1, Tx, H, K), self.A_log, self.dt_bias, self.lower_bound)
            o, ssm_out = backend.chunk(
                q,
                k,
                v,
                g,
                beta.view(1, Tx, H),
                initial_state=ssm,
                output_final_state=cache is not None,
                use_qk_l2norm=True,
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=host_cu,
                gate_lower_bound=self.lower_bound,
            )  # [1, Tx, H, V]
            if saves is not None:
                cache.save_kda_checkpoints(self.layer_id, ssm_out[N:], conv_out[N:])
                o, ssm_out, conv_out = o[:, :T], ssm_out[:N], conv_out[:N]
            if cache is not None:
                cache.set_kda_state(self.layer_id, ssm_out, conv_out)

        gate = gate if self.full_rank_gate else self.g_b_proj(gate)  # [T, P]: the output gate
        o = o.reshape(T, self.proj_dim)
        if fused_gemv_applies("gate", o, self.o_proj.weight, group=K):
            # (decode) the norm-gate inside the o projection's GEMV
            return linear_gated(o, gate, self.o_proj.weight, (self.o_norm.weight, self.eps))
        o = gated_rms_norm(o.view(T, H, K), gate.view(T, H, K), self.o_norm.weight, self.eps)  # [T, H, V]
        return self.o_proj(o.reshape(T, self.proj_dim))

    # -- weight loading ---------------------------------------------------------------------------------
    def _load_conv(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        ps, P = parallel_state(), self.proj_dim
        loaded = loaded.reshape(loaded.shape[0], -1)  # [P_full, W]
        if loaded.shape != (P * ps.tp_size, self.conv_size):
            raise ShapeMismatch(
                f"{shard_id}_conv1d: checkpoint has {tuple(loaded.shape)}, "
                f"model expects ({P * ps.tp_size}, 1, {self.conv_size})"
            )
        offset = QKV.index(shard_id) * P
        copy_checked(
            param.data[offset : offset + P], loaded.narrow(0, ps.tp_rank * P, P), f"{shard_id}_conv1d"
        )

    def _load_a_log(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        # Kimi-Linear stores [1, 1, H, 1]; K3 stores [>= H] and uses the first H entries (model-spec 1.2).
        flat = loaded.reshape(-1)
        heads = self.num_heads * parallel_state().tp_size
        if flat.numel() < heads:
            raise ShapeMismatch(f"A_log: checkpoint has {tuple(loaded.shape)}, model expects ({heads},)")
        start = parallel_state().tp_rank * self.num_heads
        copy_checked(param.data, flat[start : start + self.num_heads], "A_log")

    def _load_head_sharded(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        ps, n = parallel_state(), param.shape[0]
        if loaded.shape != (n * ps.tp_size,):
            raise ShapeMismatch(
                f"dt_bias: checkpoint has {tuple(loaded.shape)}, model expects ({n * ps.tp_size},)"
            )
        copy_checked(param.data, loaded.narrow(0, ps.tp_rank * n, n), "dt_bias")
