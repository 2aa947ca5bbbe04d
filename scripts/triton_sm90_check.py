"""Compile Triton kernels for the H200 (sm_90) on this CPU machine and print their registers, spills and shared
memory, before spending device time on them. The CPU venv's Triton bundles ptxas and cuobjdump, and
`triton.compile` needs no GPU for a given target; a kernel that fails to compile, spills (STACK > 0) or needs more
than 227 KiB of shared memory shows here. (Session 14: a 2-D [4096, 8] index mapping took the top-k select kernel
to 255 registers and 720 bytes of stack; a per-segment loop brought it to 126 and none.)

    python3 scripts/triton_sm90_check.py topk          # the DSA top-k kernels at their default tiles
    python3 scripts/triton_sm90_check.py kernel MODULE:NAME \
        --sig '{"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}' --const '{"BLOCK": 1024}' [--warps 8] [--stages 3]

The figures are those of the Triton imported. The CPU venv's is 3.9 and the GPU image's 3.6, and they differ
(the top-k compact kernel: 103 registers in 3.9, 113 in 3.6); for the device's own figures, put 3.6 first:

    python3 -m pip download --no-deps triton==3.6.0 -d /tmp/t36whl
    python3 -m pip install --no-deps --target /tmp/t36 /tmp/t36whl/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python3 scripts/triton_sm90_check.py topk
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def resource_usage(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> dict:
    """{'kernel', 'REG', 'STACK', 'SHARED', ...} of `fn` compiled for sm_90 (cuobjdump's resource usage line);
    constexprs the kernel does not take are dropped (a preset shares one dict between kernels)."""
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    signature = {k: v for k, v in signature.items() if k in fn.arg_names}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=SM90, options=options
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    usage = dict(field.split(":") for field in line.split() if ":" in field)
    return {"kernel": fn.__name__, **{k: int(v) for k, v in usage.items() if v.isdigit()}}


def topk_cases() -> list[tuple]:
    from kestrel.ops.dsa import triton_topk as t

    rows = {"scores_ptr": "*fp32", "lens_ptr": "*i64"}
    counts = {"hist1_ptr": "*i32", "hist2_ptr": "*i32", "seg_count_ptr": "*i32"}
    cands = {"cand_key_ptr": "*i32", "cand_pos_ptr": "*i32"}
    tiles = {"SEG": t.SEG, "BLOCK": t.BLOCK, "NB1": t.NB1, "NB2": t.NB2}
    sp = triton.next_power_of_2(131072 // t.SEG)
    return [
        (t._coarse_kernel, {**rows, "hist1_ptr": "*i32", "L": "i32", "stride_sb": "i32"}, tiles, {}),
        (
            t._fine_kernel,
            {**rows, **counts, "L": "i32", "num_segs": "i32", "k": "i32", "stride_sb": "i32"},
            tiles,
            {},
        ),
        (
            t._compact_kernel,
            {
                **rows,
                **counts,
                **cands,
                "L": "i32",
                "LC": "i32",
                "num_segs": "i32",
                "k": "i32",
                "stride_sb": "i32",
            },
            {**tiles, "SP": sp},
            {},
        ),
        (
            t._select_kernel,
            {
                **counts,
                **cands,
                "out_ptr": "*i64",
                "LC": "i32",
                "num_segs": "i32",
                "k": "i32",
                "stride_ob": "i32",
            },
            {"NB1": t.NB1, "NB2": t.NB2, "SP": sp, "CBLOCK": t.CBLOCK},
            {},
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser(
        "topk", help="the DSA top-k kernels (kestrel/ops/dsa/triton_topk.py) at their default tiles"
    )
    one = sub.add_parser("kernel", help="one kernel, MODULE:NAME, with its signature and constexprs as JSON")
    one.add_argument("name")
    one.add_argument("--sig", required=True, help='{"param": "*fp32" | "i32" | ... | "constexpr"}')
    one.add_argument("--const", default="{}", help='{"PARAM": value} for the constexpr parameters')
    one.add_argument("--warps", type=int, default=4)
    one.add_argument("--stages", type=int, default=3)
    args = parser.parse_args()
    if args.what == "topk":
        from kestrel.ops.dsa.triton_topk import NUM_WARPS

        cases = [
            (fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, NUM_WARPS)
            for fn, sig, const, _ in topk_cases()
        ]
    else:
        module, _, name = args.name.partition(":")
        fn = getattr(importlib.import_module(module), name)
        cases = [(fn, json.loads(args.sig), json.loads(args.const), args.warps)]
    for fn, sig, const, warps in cases:
        usage = resource_usage(fn, sig, const, num_warps=warps, num_stages=getattr(args, "stages", 3))
        print(json.dumps(usage), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
