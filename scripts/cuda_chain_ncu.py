"""The CUDA GEMV chain (kestrel.ops.linear.cuda_chain) on mini's KDA projections, 24 layers, run three times, for
Nsight Compute to profile its third launch (session 61's stall counts, on the device):

    ncu --kernel-name regex:chain_pipe --launch-skip 2 --launch-count 1 \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,smsp__inst_executed.sum" \\
        python3 scripts/cuda_chain_ncu.py ll      # pipe with LL pairs; `nob`: pipe with no barrier;
                                                  # `mma`, `mma_nob`: the same with the sums on the tensor cores
                                                  # `packed`, `packed_nob`: mma on weights packed a page a copy
                                                  # `packed4`: packed with LL, a page's sums split over 4 warps
                                                  # `best`: packed with LL at depth 2; `alone`: its consumers alone
                                                  # `best_pipe`, `alone_pipe`: the same, mma_pipelined

Session 66's per-instruction stall samples (where a warp waits, by SASS line) came from the source page:

    ncu --kernel-name regex:chain_pipe --launch-skip 2 --launch-count 1 --section SourceCounters \
        --section WarpStateStats -o $OUT/alone -f python3 scripts/cuda_chain_ncu.py alone
    ncu -i $OUT/alone.ncu-rep --page source --csv --print-source sass > $OUT/alone_sass.csv
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kestrel.ops.linear.cuda_chain import CudaGemvChain  # noqa: E402


def main() -> None:
    variants = {
        "ll": dict(pipe=True, ll=True),
        "nob": dict(pipe=True, no_barrier=True),
        "mma": dict(pipe=True, ll=True, mma=True),
        "mma_nob": dict(pipe=True, no_barrier=True, mma=True),
        "packed": dict(pipe=True, ll=True, mma=True, mma_packed=True),
        "packed_nob": dict(pipe=True, no_barrier=True, mma=True, mma_packed=True),
        "packed4": dict(pipe=True, ll=True, mma=True, mma_packed=True, mma_parts=4),
        # session 66: the best (packed, LL, 2 pages in flight) and its consumers alone (no barrier, no stream)
        "best": dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2),
        "alone": dict(pipe=True, mma=True, mma_packed=True, no_barrier=True, no_stream=True),
        # session 67: the same two with the next k-blocks' ldmatrix issued ahead (mma_pipelined)
        "best_pipe": dict(pipe=True, ll=True, mma=True, mma_packed=True, depth=2, mma_pipelined=True),
        "alone_pipe": dict(
            pipe=True, mma=True, mma_packed=True, no_barrier=True, no_stream=True, mma_pipelined=True
        ),
    }
    variant = sys.argv[1] if len(sys.argv) > 1 else "ll"
    if variant not in variants:
        raise SystemExit(f"cuda_chain_ncu.py: variant {variant!r}: one of {', '.join(variants)}")
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for _ in range(24):
        weights += [
            (torch.randn(4232, 2048, generator=g, device="cuda") * 0.02).to(torch.bfloat16),
            (torch.randn(2048, 1024, generator=g, device="cuda") * 0.05).to(torch.bfloat16),
        ]
    chain = CudaGemvChain(weights, **variants[variant])
    chain.input.copy_(torch.randn(1, 2048, device="cuda").to(torch.bfloat16))
    for _ in range(3):
        chain()
    torch.cuda.synchronize()
    print(f"{variant}: ran, gave up: {chain.gave_up()}")


if __name__ == "__main__":
    main()
