"""`kestrel env`: what this machine has and how Kestrel reads its environment, for a bug report or a run's
record. Three parts:
- the software: Python, torch (and the CUDA it was built with), Triton, fla-core, transformers and the
  serving packages, each version or "missing";
- the device: the GPUs torch sees (name, compute capability, memory) or none, and the nvcc that would build
  the CUDA top-k;
- the fast paths a model on the device takes, as the functions the layers call answer them (KDA backend,
  attention kernels, DSA top-k, PDL, the GEMV), then every variable of `kestrel.env` with its value,
  whether it is set, its default and what it takes. A variable set to a value it does not take is listed as an
  error, and the command exits with status 1 after printing everything.

`kestrel env NAME` prints one variable's whole description (NAME as `KESTREL_PDL`, `PDL` or `pdl`);
`--json` prints the report as JSON; `kestrel bench decode` and `bench kernels` put it in their results, and
scripts/gpu_suite.py in its record at the start of a run.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
import os
import platform
import sys
import textwrap

from kestrel import env as kenv
from kestrel.utils.errors import ConfigError

PACKAGES = ("torch", "triton", "fla-core", "transformers", "safetensors", "numpy", "fastapi", "uvicorn",
            "pydantic")  # fmt: skip


def variable_docs() -> dict[str, str]:
    """Each `Env` field's description (the string under it in kestrel/env.py), without its leading "NAME: "."""
    tree = ast.parse(inspect.getsource(kenv))
    env_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Env")
    docs, field = {}, None
    for node in env_class.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            field = node.target.id
        elif field and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            text = " ".join(inspect.cleandoc(node.value.value).split())
            head, _, rest = text.partition(": ")
            docs[field] = rest if head.startswith(kenv.VARIABLES[field].name) else text
            field = None
    return docs


def variables() -> list[dict]:
    """Every declared variable: its name, value (None where it is bad), text as set, default, what it takes,
    its description, and an "error" only where it is bad (the records' rule: an "error" key is a failure)."""
    docs = variable_docs()
    rows = []
    for field, var in kenv.VARIABLES.items():
        row = {"name": var.name, "field": field, "set": bool(var.text()), "text": var.text(),
               "default": var.default, "takes": var.takes(), "value": None,
               "what": var.what, "doc": docs.get(field, "")}  # fmt: skip
        if var.fallback:
            row["name"] = f"{var.name} (or {var.fallback})"
        try:
            row["value"] = var.read()
        except ValueError as e:
            row["error"] = str(e)
        rows.append(row)
    return rows


def software() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict:
    import torch

    from kestrel.ops.dsa.cuda_topk import find_nvcc

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                         "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count})  # fmt: skip
    return {"torch_cuda": torch.version.cuda, "gpus": gpus, "cpus": _cpus(), "nvcc": find_nvcc()}


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fast_paths(device) -> dict:
    """What a model on `device` runs, each as the function its layers call answers it (an error's text where
    the environment makes that function fail)."""
    import torch

    from kestrel.layers.mla import triton_attention
    from kestrel.ops.dsa.cuda_topk import find_nvcc
    from kestrel.ops.kda import get_kda_backend
    from kestrel.ops.linear import gemv_on
    from kestrel.ops.pdl import pdl_on
    from kestrel.utils.fuse import fast_applies

    cuda = device.type == "cuda"

    def answer(fn):
        try:
            return fn()
        except (ValueError, RuntimeError) as e:
            return f"error: {e}"

    def kda() -> str:
        backend = get_kda_backend(device)
        if backend.name == "naive":
            return "naive (plain-torch reference)"
        return f"fla (fla-core chunk_kda for prefill; decode step: {kenv.env_field('kda_decode')})"

    def attention() -> str:
        return "triton" if triton_attention(device) else "torch (plain-torch reference)"

    def topk() -> str:
        if not triton_attention(device):
            return "torch (the reference's selection)"
        choice = kenv.env_field("dsa_topk")
        if not cuda or choice == "triton":
            return "triton"
        nvcc = find_nvcc()
        if nvcc is None:
            return (
                "triton (no nvcc for the CUDA kernel)"
                if choice == "auto"
                else "error: no nvcc (KESTREL_DSA_TOPK=cuda)"
            )
        return f"cuda (built by {nvcc} on first use; Triton's if that fails)"

    def pdl() -> str:
        return "on" if pdl_on(device) else "off"

    def gemv() -> str:
        if not gemv_on(device):
            return "off (cuBLAS / torch)"
        from kestrel.ops.linear.triton_gemv import rows_most

        most = rows_most()
        if not most:
            return "triton K loop (up to 16 rows)"
        fuse = kenv.env_field("gemv_fuse")
        fused = {"none": "", "auto": ", fused: gate at one row"}.get(fuse, f", fused: {fuse}")
        return f"triton (up to 16 rows), rows kernel up to {most}{fused}"

    def fused() -> str:
        return "triton" if fast_applies(torch.empty(0, device=device)) else "off (plain torch)"

    paths = {"kda": kda, "attention": attention, "dsa_topk": topk, "small_ops": fused, "pdl": pdl,
             "gemv": gemv}  # fmt: skip
    return {"device": str(device), **{name: answer(fn) for name, fn in paths.items()}}


def report(device: str | None = None) -> dict:
    """The whole report for a model on `device` (a --device name; None: cuda where there is one, else cpu)."""
    from kestrel.utils.device import resolve_device

    device = resolve_device(device or "auto")  # a bad name: KestrelError, one line
    return {"software": software(), "device": device_info(), "fast_paths": fast_paths(device),
            "variables": variables(), "unknown_variables": kenv.unknown_variables()}  # fmt: skip


def report_or_error(device: str | None = None) -> dict:
    """`report`, or {"error": ...} where it fails: for a benchmark's record, which it must never cost."""
    try:
        return report(device)
    except Exception as e:
        return {"error": repr(e)}


def format_report(rep: dict, width: int = 118) -> str:
    sw, dev, paths = rep["software"], rep["device"], rep["fast_paths"]
    lines = [f"Python {sw['python']} on {sw['platform']}, {dev['cpus']} CPUs"]
    versions = ", ".join(f"{k} {v or 'missing'}" for k, v in sw.items() if k in PACKAGES)
    lines += textwrap.wrap(versions, width, initial_indent="  ", subsequent_indent="  ")
    cuda = f"torch built with CUDA {dev['torch_cuda']}" if dev["torch_cuda"] else "torch without CUDA"
    gpus = "; ".join(f"{g['index']}: {g['name']} (sm_{g['capability'].replace('.', '')}, {g['memory_gib']} GiB, "
                     f"{g['sms']} SMs)" for g in dev["gpus"]) or "none"  # fmt: skip
    lines += [f"GPUs: {gpus} ({cuda})", f"nvcc: {dev['nvcc'] or 'not found'}", ""]
    lines.append(f"Fast paths for a model on {paths['device']}:")
    for name, value in paths.items():
        if name != "device":
            lines.append(f"  {name:<11} {value}")
    lines += ["", "Variables (* set here; `kestrel env NAME`: what one takes, and its whole description):"]
    rows = rep["variables"]
    w_name = max(len(r["name"]) for r in rows) + 2
    w_value = max(8, *(len(_shown(r)) for r in rows if not r.get("error")))
    for r in rows:
        mark = "*" if r["set"] else " "
        if r.get("error"):
            lines.append(f"{mark} {r['name']:<{w_name}}ERROR {r['error']}")
            continue
        line = f"{mark} {r['name']:<{w_name}}{_shown(r):<{w_value}}  {r['what']}"
        lines.append(line if len(line) <= width else line[: width - 4].rstrip() + " ...")
    lines += [f"! {line}" for line in rep.get("unknown_variables", [])]
    return "\n".join(lines)


def _shown(row: dict) -> str:
    value = row["value"]
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != "" else "-"


def variable(name: str) -> dict:
    """One variable's row of the report: `name` as its variable (any case, KESTREL_ prefix optional) or field."""
    key = name.strip().lower().removeprefix("kestrel_")
    fields = [f for f, v in kenv.VARIABLES.items() if key in (f, v.name.lower().removeprefix("kestrel_"))]
    if not fields:
        known = ", ".join(v.name for v in kenv.VARIABLES.values())
        raise ConfigError(f"unknown variable {name!r} (known: {known})")
    return next(r for r in variables() if r["field"] == fields[0])


def describe(name: str) -> str:
    """One variable's whole entry (`variable`), as text."""
    row = variable(name)
    value = f"ERROR {row.get('error')}" if row.get("error") else _shown(row)
    default = {True: "on", False: "off", "": "-"}.get(row["default"], row["default"])
    head = [f"{row['name']} = {value}{' (set)' if row['set'] else ' (the default)'}",
            f"  default: {default}", f"  takes: {row['takes']}"]  # fmt: skip
    return "\n".join(head + [""] + textwrap.wrap(row["doc"], 100))


def cmd_env(args) -> int:
    if args.name is not None:  # ("" is no variable: it printed the whole report)
        row = variable(args.name)
        print(json.dumps(row, indent=1, default=str) if args.json else describe(args.name))
        if row.get("error"):  # as the whole report does: a script asking about one variable hears it is bad
            print(f"kestrel: error: {row['error']}", file=sys.stderr)
            return 1
        return 0
    rep = report(args.device)
    print(json.dumps(rep, indent=1, default=str) if args.json else format_report(rep))
    bad = [r.get("error") for r in rep["variables"] if r.get("error")]
    if bad:
        print(f"kestrel: error: {len(bad)} bad environment variable{'s' * (len(bad) > 1)}", file=sys.stderr)
        return 1
    return 0
