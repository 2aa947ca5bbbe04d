"""Dense GLU MLP and the MoE block: sigmoid router with correction bias, routed experts (optionally latent),
shared experts (model-spec 3).

Legend: T tokens, D hidden, E experts (local to this rank under EP), A experts per token, I expert width,
Din the experts' input width (D, or the latent width of K3's latent MoE).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.env import env_field, fused_ops_on
from kestrel.layers.context import get_forward_context, has_forward_context
from kestrel.layers.linear import (
    ColumnLinear,
    Linear,
    RowLinear,
    ShapeMismatch,
    copy_checked,
    default_weight_loader,
    set_loader,
)
from kestrel.layers.norm import RMSNorm
from kestrel.ops.activation import glu_act
from kestrel.ops.moe import grouped_mm_trains, moe_experts, moe_experts_grouped, replay_route, route
from kestrel.ops.moe.router_gemm import mm_fp32_out_works, router_logit_parts_bf16x3, split_bf16x3
from kestrel.ops.norm import rms_norm
from kestrel.utils.dist import parallel_state

ALL_EXPERTS = "all"  # shard id of a checkpoint tensor that holds every expert stacked (transformers layout)
# Up to this many (token, slot) pairs the routed experts run in Triton (ops.moe.triton_experts), above it through
# torch._grouped_mm (with the Triton combine at inference). On the H200 at mini's sizes, in CUDA graphs: T = 1024
# 223 vs 227 us, T = 2048 322 vs 273 us, T = 4096 494 vs 386 us (`kestrel bench kernels`, session 8).
TRITON_EXPERTS_MAX_PAIRS = 1024 * 6
# Tokens up to which the fused router also computes the router's logits (route_hidden_triton); past it, up to
# ROUTER_DOT_MAX_TOKENS, a Triton kernel multiplies x by the weight's exact bf16 split (`router_logit_parts_triton`),
# and past that cuBLAS's GEMM does (`Router.inference_logits`), each followed by the fused router. On the H200 at
# mini's sizes, 24 calls in a CUDA graph, us a call, GEMV router / Triton split / cuBLAS split (session 25,
# bench/results/2026-12-01-h200-session25.json): T = 1 4.6 / 6.0 / 8.3, 16 6.2 / 6.2 / 8.6, 64 7.9 / 7.0 / 8.7,
# 128 11.4 / 7.9 / 8.7, 256 17.9 / 10.2 / 8.9, 1024 53.3 / 13.0 / 11.0. Every path picked the reference's experts.
ROUTER_GEMV_MAX_TOKENS = 16
ROUTER_DOT_MAX_TOKENS = 128
# Tokens up to which the shared experts run on a side stream (KESTREL_MOE_OVERLAP_SHARED): decode sizes, where
# neither the routed experts nor the shared ones fill the GPU (timed at batch 1 and 64).
OVERLAP_SHARED_MAX_TOKENS = 256
# Tokens up to which the whole layer runs in one launch (KESTREL_MOE_FUSED_DECODE, `MoE._whole_in_one_launch`):
# batch-1 decode, the case the kernel was written and timed for.
FUSED_DECODE_MAX_TOKENS = 1
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class DenseMLP(nn.Module):
    """down(act(gate(x), up(x))); gate and up are one merged projection."""

    def __init__(self, config: ModelConfig, intermediate_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.act, self.beta, self.linear_beta = config.hidden_act, config.situ_beta, config.situ_linear_beta
        I = intermediate_size
        self.gate_up_proj = ColumnLinear(
            config.hidden_size, dtype=dtype, output_sizes=[I, I], shard_names=("gate", "up")
        )
        self.down_proj = RowLinear(I, config.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        """down(act(gate(x), up(x))); with add_to, add_to += it in place (MoE.forward's contract)."""
        out = self.down_proj(glu_act(self.gate_up_proj(x), self.act, self.beta, self.linear_beta))
        return out if add_to is None else add_to.add_(out)


class Router(nn.Module):
    """Router weight [E, D] and correction bias [E], both fp32 (the bias steers selection only)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = set_loader(
            nn.Parameter(torch.empty(config.num_experts, config.hidden_size)), self._load_weight
        )
        self.e_score_correction_bias = set_loader(
            nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        )
        # inference_logits' bf16 split of the weight, and the (version, address) of the weight it was made from
        self._split: torch.Tensor | None = None
        self._split_key: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 in training too: under autocast the matmul would run in bf16, and the experts a token picks would
        # then differ between training and inference (an fp32 router is what aligns them: reference/rl.md)
        with torch.autocast(x.device.type, enabled=False):
            return x.float() @ self.weight.float().t()  # [T, E] fp32 logits

    def inference_logits(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        """`forward`'s logits for bf16 x on CUDA, without autograd: one bf16 tensor-core GEMM over the weight's
        exact three-way bf16 split (kestrel.ops.moe.router_gemm: the same products, summed in fp32 by the tensor
        cores in another order; on the H200 a max error of 1.0e-5 where cuBLAS' fp32 GEMM has 1.9e-6, so a token
        on a near-tie can pick another expert than `forward` would). Train/rollout consistency in RL comes from
        routing replay (the rollout's ids replayed in training), not from equal logits; KESTREL_FUSED_OPS=off
        goes back to `forward`. parts=True: [T, S, E] partial logits that sum to them (S = 3, the products with
        each part of the split; up to ROUTER_DOT_MAX_TOKENS tokens, S slices of D from one Triton kernel; S = 1
        where `forward` answers), for the fused router to add. The split lives in
        one buffer, refilled in place when the weight changes (an in-place update, or a checkpoint load through
        `_load_weight`), so captured CUDA graphs keep reading it."""
        assert not torch.is_grad_enabled(), "inference_logits has no backward: use forward"
        if x.dtype != torch.bfloat16 or not x.is_cuda or not mm_fp32_out_works(x.device):
            return self(x)[:, None] if parts else self(x)
        key = (self.weight._version, self.weight.data_ptr())
        if self._split_key != key:
            split = split_bf16x3(self.weight.detach())
            if (
                self._split is not None
                and self._split.shape == split.shape
                and self._split.device == split.device
            ):
                self._split.copy_(split)  # in place: a captured graph reads this buffer
            else:
                self._split = split
            self._split_key = key
        if parts and x.shape[0] <= ROUTER_DOT_MAX_TOKENS:
            from kestrel.ops.moe.triton_router import router_logit_parts_triton

            return router_logit_parts_triton(x, self._split)  # [T, S, E]: slices of D
        out = router_logit_parts_bf16x3(x, self._split)  # [T, 3, E]
        return out if parts else out.sum(1)

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """The checkpoint loader's copy (through .data, which moves no version counter), then the split is
        stale."""
        default_weight_loader(param, loaded, shard_id)
        self._split_key = None


class Experts(nn.Module):
    """Routed experts stacked: w13 [E, 2I, Din] (gate rows, then up rows), w2 [E, Din, I]."""

    def __init__(self, num_experts: int, in_size: int, inter_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        ps = parallel_state()
        if num_experts % ps.ep_size:
            raise ValueError(f"{num_experts} experts not divisible by ep_size={ps.ep_size}")
        self.num_local = num_experts // ps.ep_size
        self.first = ps.ep_rank * self.num_local
        self.in_size, self.inter_size = in_size, inter_size
        local = range(self.first, self.first + self.num_local)
        self.w13 = set_loader(
            nn.Parameter(torch.empty(self.num_local, 2 * inter_size, in_size, dtype=dtype)),
            self._load,
            [(e, p) for e in local for p in ("w1", "w3")],
        )
        self.w2 = set_loader(
            nn.Parameter(torch.empty(self.num_local, in_size, inter_size, dtype=dtype)),
            self._load,
            [(e, "w2") for e in local],
        )

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        expert, part = shard_id
        I = self.inter_size
        if expert == ALL_EXPERTS:  # [E, 2I, Din] or [E, Din, I], every expert at once
            n = self.num_local
            full = (n * parallel_state().ep_size, *param.shape[1:])
            if tuple(loaded.shape) != full:
                raise ShapeMismatch(
                    f"experts.{part}: checkpoint has {tuple(loaded.shape)}, model expects {full}"
                )
            copy_checked(param.data, loaded.narrow(0, self.first, n), f"experts.{part}")
            return
        local = expert - self.first
        if not 0 <= local < self.num_local:
            return  # another rank's expert
        rows = {"w1": slice(0, I), "w3": slice(I, 2 * I), "w2": slice(None)}[part]
        copy_checked(param.data[local, rows], loaded, f"experts.{expert}.{part}")


def _is_triton_experts(fn) -> bool:
    return getattr(fn, "__name__", "") == "moe_experts_triton"


def routed_experts_fn(h: torch.Tensor, ids: torch.Tensor):
    """The routed-experts function for inputs h [T, Din] and ids [T, A]: Triton at decode sizes (inference
    only), else the grouped path (no host syncs, so CUDA graphs; training uses it where its backward works),
    else the reference loop."""
    if not h.is_cuda:
        return moe_experts
    inference = not torch.is_grad_enabled()
    if (
        inference
        and ids.numel() <= TRITON_EXPERTS_MAX_PAIRS
        and h.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and env_field("moe_decode_kernel") == "auto"
    ):
        from kestrel.ops.moe.triton_experts import moe_experts_triton

        return moe_experts_triton
    return moe_experts_grouped if inference or grouped_mm_trains(h.device.type) else moe_experts


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.top_k, self.renormalize = config.num_experts_per_token, config.moe_renormalize
        self.scaling, self.groups, self.topk_groups = (
            config.routed_scaling_factor,
            config.num_expert_group,
            config.topk_group,
        )
        if self.topk_groups == self.groups:  # every group kept: plain top-k, which the fused routers take
            self.groups = self.topk_groups = 1
        self.act, self.beta, self.linear_beta = config.hidden_act, config.situ_beta, config.situ_linear_beta
        self.eps = config.rms_norm_eps
        self.gate = Router(config)
        self.experts = Experts(
            config.num_experts, config.expert_input_size, config.moe_intermediate_size, dtype
        )
        if config.routed_expert_hidden_size is not None:
            lat = config.routed_expert_hidden_size
            self.routed_expert_down_proj = Linear(config.hidden_size, lat, dtype=dtype)
            self.routed_expert_up_proj = Linear(lat, config.hidden_size, dtype=dtype)
            self.routed_expert_norm = (
                RMSNorm(lat, self.eps, dtype=dtype) if config.latent_moe_use_norm else None
            )
        self.shared_experts = (
            DenseMLP(config, config.moe_intermediate_size * config.num_shared_experts, dtype)
            if config.num_shared_experts
            else None
        )

    def _shared_in_experts(self, x: torch.Tensor, experts) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared MLP's (gate_up [2I, D], down [D, I]) weights where the routed experts' Triton kernels can
        run it as one more expert every token takes (KESTREL_MOE_FUSE_SHARED), at decode sizes (up to
        OVERLAP_SHARED_MAX_TOKENS tokens: the sizes it was timed at) where `_shared_as_expert` allows. Else None."""
        if not _is_triton_experts(experts) or x.shape[0] > OVERLAP_SHARED_MAX_TOKENS:
            return None
        return self._shared_as_expert() if env_field("moe_fuse_shared") else None

    def _shared_as_expert(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared MLP's (gate_up [2I, D], down [D, I]) where it can run as one more routed expert: one shared
        expert, no latent MoE; this rank's shard of it has the experts' width and input (under tensor
        parallelism its partial output is added as the unfused path adds it, and the caller reduces both alike)
        and their dtype. Else None."""
        mlp = self.shared_experts
        if mlp is None or hasattr(self, "routed_expert_down_proj"):
            return None
        gate_up, down, w13 = mlp.gate_up_proj.weight, mlp.down_proj.weight, self.experts.w13
        _, two_i, din = w13.shape
        if gate_up.shape != (two_i, din) or down.shape != (din, two_i // 2):
            return None
        if not gate_up.dtype == down.dtype == w13.dtype == self.experts.w2.dtype:
            return None
        return gate_up, down

    def _whole_in_one_launch(self, x: torch.Tensor, add_to: torch.Tensor | None, ctx) -> torch.Tensor | None:
        """`forward`'s result from one kernel (kestrel.ops.moe.triton_decode: router, routed and shared experts,
        combine, residual add) where it applies: KESTREL_MOE_FUSED_DECODE, up to FUSED_DECODE_MAX_TOKENS tokens,
        one rank (every expert here, no tensor-parallel shards), no latent MoE, the shared MLP as one more expert
        (`_shared_as_expert`, KESTREL_MOE_FUSE_SHARED) or none, x in the experts' dtype. Else None: the caller
        runs the layer as usual."""
        if x.shape[0] > FUSED_DECODE_MAX_TOKENS or not env_field("moe_fused_decode"):
            return None
        if env_field("moe_decode_kernel") != "auto" or hasattr(self, "routed_expert_down_proj"):
            return None
        ps = parallel_state()
        w13, w2 = self.experts.w13, self.experts.w2
        if ps.tp_size != 1 or ps.ep_size != 1 or not x.dtype == w13.dtype == w2.dtype:
            return None
        shared = self._shared_as_expert() if env_field("moe_fuse_shared") else None
        if self.shared_experts is not None and shared is None:
            return None
        from kestrel.ops.moe.triton_decode import moe_decode_triton

        into = add_to is not None and add_to.is_contiguous() and add_to.dtype == x.dtype
        out, _, ids = moe_decode_triton(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            self.top_k,
            self.renormalize,
            self.scaling,
            w13,
            w2,
            self.act,
            self.beta,
            self.linear_beta,
            shared=shared,
            out=add_to if into else None,
            accumulate=into,
        )
        if ctx is not None and ctx.routing_capture is not None:
            ctx.routing_capture[self.layer_id] = ids
        return out if add_to is None or into else add_to.add_(out)

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:  # [T, D]
        """The block's output [T, D]; with add_to [T, D], add_to += it (in place, rounded as `add_`) and
        add_to returned: the residual add, inside the routed experts' last kernel where they run in Triton and
        their output is the whole block's (no latent MoE; the shared MLP fused into them, or none)."""
        ctx = get_forward_context() if has_forward_context() else None
        replay = ctx is not None and ctx.routing_replay is not None
        # one fused kernel, no autograd (KESTREL_FUSED_OPS=off: the reference); at decode sizes it computes
        # the router's logits too. The Triton routers know no expert groups: grouped routing takes the reference
        fused = (
            x.is_cuda and self.groups == 1 and not torch.is_grad_enabled() and fused_ops_on() and not replay
        )
        whole = self._whole_in_one_launch(x, add_to, ctx) if fused else None
        if whole is not None:
            return whole
        if fused and x.shape[0] <= ROUTER_GEMV_MAX_TOKENS:
            from kestrel.ops.moe.triton_router import route_hidden_triton

            weights, ids = route_hidden_triton(
                x,
                self.gate.weight,
                self.gate.e_score_correction_bias,
                self.top_k,
                self.renormalize,
                self.scaling,
            )  # [T, A] fp32, [T, A]
        elif replay:  # the experts chosen in an earlier pass
            ids = ctx.routing_replay[self.layer_id]  # [T, A]
            weights = replay_route(self.gate(x), ids, self.renormalize, self.scaling)
        else:
            # [T, 3, E] parts of the fp32 logits (added inside the fused router), else [T, E]
            logits = self.gate.inference_logits(x, parts=True) if fused else self.gate(x)
            if fused:
                from kestrel.ops.moe.triton_router import route_triton

                weights, ids = route_triton(
                    logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize, self.scaling
                )
            else:
                weights, ids = route(
                    logits,
                    self.gate.e_score_correction_bias,
                    self.top_k,
                    self.renormalize,
                    self.scaling,
                    self.groups,
                    self.topk_groups,
                )  # [T, A] fp32, [T, A]
        if ctx is not None and ctx.routing_capture is not None:
            ctx.routing_capture[self.layer_id] = ids
        if self.experts.first:  # global -> local ids (one rank: already local, and no kernel spent on it)
            ids = ids - self.experts.first
        # decided on x, which h (below) follows: the same device, and at inference the same dtype
        experts = routed_experts_fn(x, ids)
        triton = _is_triton_experts(experts)
        in_experts = self._shared_in_experts(x, experts)  # the shared MLP's weights, run as one more expert
        latent = hasattr(self, "routed_expert_down_proj")
        extra = {} if in_experts is None else {"shared": in_experts}
        # the experts' combine gives the block's whole output (no latent up-projection, no shared MLP apart):
        # it adds it into add_to itself
        into = (
            add_to is not None
            and triton
            and not latent
            and (self.shared_experts is None or in_experts is not None)
            and add_to.is_contiguous()
            and add_to.dtype == x.dtype
        )
        if into:
            extra |= {"out": add_to, "accumulate": True}
        shared = None
        if (
            in_experts is None
            and self.shared_experts is not None
            and x.is_cuda
            and x.shape[0] <= OVERLAP_SHARED_MAX_TOKENS
            and not torch.is_grad_enabled()
            and env_field("moe_overlap_shared")
        ):
            if env_field("moe_sort_first") and triton:
                from kestrel.ops.moe.triton_experts import sort_pairs

                # the routed pairs sorted on the whole GPU, before the shared experts take part of it
                experts = functools.partial(experts, sorted_pairs=sort_pairs(ids, self.experts.w13.shape[0]))
            # Fork: the side stream starts after everything queued so far (x included); joined below.
            main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self.shared_experts(x)
        h = self.routed_expert_down_proj(x) if latent else x  # [T, Din]
        if torch.is_autocast_enabled(h.device.type):  # training: the experts run in the autocast dtype too
            h = h.to(torch.get_autocast_dtype(h.device.type))
        routed = experts(
            h,
            self.experts.w13,
            self.experts.w2,
            weights,
            ids,
            self.act,
            self.beta,
            self.linear_beta,
            **extra,
        )  # [T, Din]; with in_experts, routed + shared already; with accumulate, add_to += them (is add_to)
        if latent:
            if self.routed_expert_norm is not None:
                routed = rms_norm(routed, self.routed_expert_norm.weight, self.eps)
            routed = self.routed_expert_up_proj(routed)  # [T, D]
        if shared is not None:
            main.wait_stream(side)  # join: the shared experts' output is ready for the main stream
        elif self.shared_experts is not None and in_experts is None:
            shared = self.shared_experts(x)
        out = routed if shared is None else routed + shared
        if add_to is None or into:
            return out
        return add_to.add_(out)
