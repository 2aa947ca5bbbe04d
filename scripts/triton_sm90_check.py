"""Compile Triton kernels for the H200 (sm_90) on this CPU machine and print their registers, spills and shared
memory, before spending device time on them. The CPU venv's Triton bundles ptxas and cuobjdump, and
`triton.compile` needs no GPU for a given target; a kernel that fails to compile, spills (STACK > 0) or needs more
than 227 KiB of shared memory shows here. (Session 14: a 2-D [4096, 8] index mapping took the top-k select kernel
to 255 registers and 720 bytes of stack; a per-segment loop brought it to 126 and none.)

    python3 scripts/triton_sm90_check.py topk          # the DSA top-k kernels at their default tiles
    python3 scripts/triton_sm90_check.py kernel MODULE:NAME \
        --sig '{"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}' --const '{"BLOCK": 1024}' \
        [--warps 8] [--stages 3] [--div x_ptr,n] [--ptx ld.global --ptx griddepcontrol]

--div takes parameters as multiples of 16 (Triton specializes pointers and ints so at launch when they are; without
it the loads through them compile to scalar ones); --ptx prints the PTX lines holding a text, in order (session 55:
the rows GEMV's weight loads, all 16-byte and before `griddepcontrol.wait`).

The figures are those of the Triton imported. The CPU venv's is 3.9 and the GPU image's 3.6, and they differ
(the top-k compact kernel: 103 registers in 3.9, 113 in 3.6); for the device's own figures, put 3.6 first:

    python3 -m pip download --no-deps triton==3.6.0 -d /tmp/t36whl
    python3 -m pip install --no-deps --target /tmp/t36 /tmp/t36whl/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 python3 scripts/triton_sm90_check.py topk
"""

from __future__ import annotations

import argparse
import importlib
import inspect
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


def compile_sm90(
    fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3, divisible: tuple = ()
):
    """`fn` compiled for sm_90. `signature` and `constexprs` may name parameters `fn` does not take (a preset
    shares them between kernels); the constexprs need no entry in `signature`, and those with a default in the
    kernel may be left out. `divisible`: the parameters
    (pointers, ints) to take as multiples of 16, as Triton specializes them at launch when they are (without it
    a load through them compiles to scalar loads)."""
    defaults = {  # constexprs left out take the kernel's defaults
        k: v.default
        for k, v in inspect.signature(fn.fn).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    constexprs = {k: v for k, v in {**defaults, **constexprs}.items() if k in fn.arg_names}
    signature = {
        k: "constexpr" if k in constexprs else signature[k] for k in fn.arg_names
    }  # in parameter order
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible if k in fn.arg_names}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=SM90,
        options=options,
    )


def ptx_lines(compiled, pattern: str) -> list[str]:
    """The PTX lines holding `pattern`, each with its line number: the order of loads, waits and barriers."""
    return [
        f"{i}: {line.strip()}" for i, line in enumerate(compiled.asm["ptx"].splitlines()) if pattern in line
    ]


def compiled_usage(fn, compiled) -> dict:
    """{'kernel', 'REG', 'STACK', 'SHARED', ...} of `fn` compiled for sm_90 (`compile_sm90`): cuobjdump's resource
    usage line."""
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


def topk_preset() -> tuple[list, dict, dict, int]:
    """The top-k kernels, the types of every parameter any of them takes, their default tiles (SP for a row
    of 131072 scores) and their warps."""
    from kestrel.ops.dsa import triton_topk as t

    kernels = [t._coarse_kernel, t._fine_kernel, t._compact_kernel, t._select_kernel]
    pointers = {"scores_ptr": "*fp32", "lens_ptr": "*i64", "out_ptr": "*i64"}
    for name in ("hist1_ptr", "hist2_ptr", "seg_count_ptr", "cand_key_ptr", "cand_pos_ptr"):
        pointers[name] = "*i32"
    ints = dict.fromkeys(("L", "LC", "num_segs", "k", "stride_sb", "stride_ob"), "i32")
    sp = triton.next_power_of_2(131072 // t.SEG)
    tiles = {"SEG": t.SEG, "BLOCK": t.BLOCK, "NB1": t.NB1, "NB2": t.NB2, "SP": sp, "CBLOCK": t.CBLOCK}
    return kernels, {**pointers, **ints}, tiles, t.NUM_WARPS


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
    one.add_argument(
        "--sig", required=True, help='{"param": "*fp32" | "i32" | ...} (constexprs may be left out)'
    )
    one.add_argument("--const", default="{}", help='{"PARAM": value} for the constexpr parameters')
    one.add_argument("--warps", type=int, default=4)
    one.add_argument("--stages", type=int, default=3)
    one.add_argument(
        "--div", default="", help="parameters to take as multiples of 16, comma-separated (as at launch)"
    )
    one.add_argument(
        "--ptx", action="append", default=[], help="print the PTX lines holding this text (repeatable)"
    )
    args = parser.parse_args()
    divisible, patterns = (), []
    if args.what == "topk":
        kernels, sig, const, warps = topk_preset()
        stages = 3
    else:
        module, _, name = args.name.partition(":")
        kernels = [getattr(importlib.import_module(module), name)]
        sig, const, warps, stages = json.loads(args.sig), json.loads(args.const), args.warps, args.stages
        divisible, patterns = tuple(filter(None, args.div.split(","))), args.ptx
    for fn in kernels:
        compiled = compile_sm90(fn, sig, const, warps, stages, divisible)
        print(json.dumps(compiled_usage(fn, compiled)), flush=True)
        if patterns:
            lines = sorted(
                {line for p in patterns for line in ptx_lines(compiled, p)},
                key=lambda x: int(x.split(":")[0]),
            )
            print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
