"""`kestrel bench kernels`: each fast-path kernel on the GPU — its time, the bytes it must move and its FLOPs,
the achieved bandwidth or FLOP rate against the ceilings measured in the same run, and, where one exists,
the plain-PyTorch peer timed beside it (with a check that both give the same answer). The benchmarks live by
op family (kernels_dsa, kernels_moe, kernels_kda); this module holds their cases and runs them."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch

from kestrel.bench.kernels_dsa import (
    bench_indexer,
    bench_indexer_prefill,
    bench_sparse_mla,
    bench_sparse_mla_prefill,
    bench_topk,
)
from kestrel.bench.kernels_kda import bench_kda_conv_prefill, bench_kda_decode
from kestrel.bench.kernels_moe import bench_moe, bench_router
from kestrel.bench.roofline import device_name, measure_ceilings, require_cuda
from kestrel.serve.env_report import report_or_error
from kestrel.utils.paths import check_writable

# The shapes of `kestrel bench kernels` (the H200's): keyword arguments of each bench_* function.
KERNEL_CASES = {
    "topk": [{}, {"kind": "ramp"}, {"kind": "ties"}],
    "indexer": [
        {"batch": b, "context": c, "heads": 16, "dim": 128} for b, c in ((1, 4096), (64, 4096), (64, 131072))
    ],
    "indexer_prefill": [
        {"tokens": t, "context": c, "heads": 16, "dim": 128} for t, c in ((4096, 4096), (8192, 32768))
    ],
    "sparse_mla": [
        {"batch": b, "context": c, "k": k}
        for b, c, k in ((1, 4096, 2048), (64, 4096, 2048), (64, 131072, 2048), (64, 4096, None))
    ],
    # the last three: short chunks after a long history, where `use_expanded`'s expansion term (an estimate) decides
    "sparse_mla_prefill": [
        {"tokens": t, "context": c, "k": 2048}
        for t, c in ((4096, 4096), (4096, 16384), (4096, 32768), (64, 8192), (512, 32768), (1, 32768))
    ],
    "router": [{"tokens": t} for t in (1, 64, 128, 256, 512)],
    "moe": [{"tokens": t} for t in (1, 64, 256, 1024, 2048, 4096, 8192, 32768)],
    "kda_decode": [{"batch": b} for b in (1, 64, 256)],
    "kda_conv_prefill": [{"tokens": 32768}],
}
_BENCHES = {
    "topk": bench_topk,
    "indexer": bench_indexer,
    "indexer_prefill": bench_indexer_prefill,
    "sparse_mla": bench_sparse_mla,
    "sparse_mla_prefill": bench_sparse_mla_prefill,
    "router": bench_router,
    "moe": bench_moe,
    "kda_decode": bench_kda_decode,
    "kda_conv_prefill": bench_kda_conv_prefill,
}


@torch.no_grad()  # inference, as the engine runs them (the MoE grouped path picks its combine by it)
def kernels_bench(device: str = "cuda", cases: dict = KERNEL_CASES) -> dict:
    """Every case of `cases` on `device`: CUDA, or the CPU with the kernels in Triton's interpreter
    (TRITON_INTERPRET=1, the smoke run of scripts/gpu_suite.py at tiny shapes)."""
    if torch.device(device).type == "cuda":
        require_cuda("kestrel bench kernels")
    ceilings = measure_ceilings(device)
    print(
        f"ceilings: copy {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    results = []
    for name, kws in cases.items():
        for kw in kws:
            result = _BENCHES[name](ceilings, **kw, device=device)  # one row, or several side by side
            results += result if isinstance(result, list) else [result]
    return {
        "benchmark": "kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": device_name(device),
        "torch": torch.__version__,
        "ceilings": ceilings,
        "kernels": results,
        "env": report_or_error(str(device)),  # the versions, the fast paths selected, every variable
    }


def cmd_bench_kernels(args) -> int:
    check_writable(args.out, "--out")  # before the run, not after it
    result = kernels_bench()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0
