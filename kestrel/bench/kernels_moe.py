"""`kestrel bench kernels`: the MoE kernels (the routed experts at decode and prefill sizes, the router from the
hidden states), each against the path it replaces."""

from __future__ import annotations

import torch

from kestrel.bench.measure import kernel_row
from kestrel.bench.roofline import graph_ms, time_ms


def bench_moe(
    ceilings: dict,
    tokens: int,
    experts: int = 64,
    top_k: int = 6,
    hidden: int = 2048,
    inter: int = 256,
    device: str = "cuda",
) -> list[dict]:
    """The routed experts at `mini`'s sizes: the grouped path (torch._grouped_mm), then the Triton decode path
    beside it (its peer: the grouped time, and how far apart the two answers are). On CUDA also `graph_ms`: each
    path replayed in a CUDA graph of 8 calls on 8 weight copies (1.6 GB at mini's sizes), the time decode sees."""
    from kestrel.ops.moe.grouped import moe_experts_grouped
    from kestrel.ops.moe.triton_experts import moe_experts_triton

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02
    ids = torch.rand(tokens, experts, device=device).argsort(-1)[:, :top_k]  # [T, A] distinct per token
    weights = torch.rand(tokens, top_k, device=device)
    grouped_ms = time_ms(lambda: moe_experts_grouped(x, w13, w2, weights, ids, "silu"), device)
    # the grouped path's end in torch (fp32 copies, a scatter back to pair order, a sum) instead of one kernel
    torch_combine_ms = time_ms(
        lambda: moe_experts_grouped(x, w13, w2, weights, ids, "silu", triton_combine=False), device
    )
    triton_ms = time_ms(lambda: moe_experts_triton(x, w13, w2, weights, ids, "silu"), device)
    graph: dict = {"grouped": {}, "triton": {}}
    if torch.device(device).type == "cuda":
        layers = [(w13, w2)] + [(torch.randn_like(w13) * 0.02, torch.randn_like(w2) * 0.02) for _ in range(7)]
        for key, fn in (("grouped", moe_experts_grouped), ("triton", moe_experts_triton)):
            calls = [lambda a=a, b=b, fn=fn: fn(x, a, b, weights, ids, "silu") for a, b in layers]
            try:  # the eager figures still come back if a capture fails
                graph[key] = {"graph_ms": graph_ms(calls)}
            except RuntimeError as e:
                graph[key] = {"graph_error": repr(e)[:300]}
        del layers
    a = moe_experts_grouped(x, w13, w2, weights, ids, "silu").float()
    b = moe_experts_triton(x, w13, w2, weights, ids, "silu").float()
    rel_err = float((a - b).norm() / a.norm().clamp_min(1e-30))
    hit = int(ids.unique().numel())
    nbytes = hit * 3 * hidden * inter * 2 + 2 * tokens * hidden * 2
    flops = 2 * tokens * top_k * 3 * hidden * inter
    shape = f"T={tokens} E={experts} k={top_k}"
    return [
        kernel_row(
            f"grouped MoE experts {shape}",
            grouped_ms,
            nbytes,
            flops,
            ceilings,
            experts_hit=hit,
            peer="moe_experts_grouped with its torch combine (fp32 copies, scatter, sum)",
            peer_ms=torch_combine_ms,
            **graph["grouped"],
        ),
        kernel_row(
            f"fused MoE decode (triton) {shape}",
            triton_ms,
            nbytes,
            flops,
            ceilings,
            experts_hit=hit,
            peer="moe_experts_grouped",
            peer_ms=grouped_ms,
            rel_err_vs_peer=rel_err,
            **graph["triton"],
        ),
    ]


def bench_router(
    ceilings: dict, tokens: int, experts: int = 64, top_k: int = 6, hidden: int = 2048, device: str = "cuda"
) -> dict:
    """The MoE router from the hidden states at `mini`'s sizes (decode's path: logits and routing in Triton).
    Peer: the path above the decode sizes, the router GEMM (on CUDA one bf16 GEMM over the weight's exact
    three-way split, `Router.inference_logits`; else the fp32 matmul) then the routing kernel adding its parts.
    Both in CUDA graphs of 8 layers' calls on CUDA, as decode replays them."""
    from kestrel.ops.moe.router_gemm import mm_fp32_out_works, router_logit_parts_bf16x3, split_bf16x3
    from kestrel.ops.moe.triton_router import route_hidden_triton, route_triton

    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(experts, hidden, device=device) * hidden**-0.5 for _ in range(8)]
    bias = torch.randn(experts, device=device) * 0.1
    split = mm_fp32_out_works(x.device)
    parts = {w.data_ptr(): split_bf16x3(w) for w in weights} if split else {}

    def fused(w):
        return route_hidden_triton(x, w, bias, top_k, True, 2.5)

    def gemm_then_route(w):
        logits = router_logit_parts_bf16x3(x, parts[w.data_ptr()]) if split else x.float() @ w.t()
        return route_triton(logits, bias, top_k, True, 2.5)

    ms, peer_ms = (
        time_ms(lambda: fused(weights[0]), device),
        time_ms(lambda: gemm_then_route(weights[0]), device),
    )
    extra = {}
    if torch.device(device).type == "cuda":
        extra["graph_ms"] = graph_ms([lambda w=w: fused(w) for w in weights])
        extra["peer_graph_ms"] = graph_ms([lambda w=w: gemm_then_route(w) for w in weights])
    same = torch.equal(fused(weights[0])[1], gemm_then_route(weights[0])[1])
    return kernel_row(
        f"MoE router from hidden T={tokens} E={experts} D={hidden}",
        ms,
        experts * hidden * 4 + tokens * hidden * 2,
        2 * tokens * experts * hidden,
        ceilings,
        peer="router GEMM (bf16 x3 split on CUDA), then the routing kernel",
        peer_ms=peer_ms,
        same_experts_as_peer=same,
        **extra,
    )
