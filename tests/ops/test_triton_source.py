"""What the Triton interpreter accepts and the compiler does not, checked on the source of every kernel.

CI runs our kernels under TRITON_INTERPRET=1 only, so a construct that compiles differently is found on the GPU
or not at all. Session 37 found one on the H200: a `@triton.jit` helper with a string default
(`CACHE: tl.constexpr = ""`) passed the interpreter, but Triton 3.6's compiler handed the default to the helper
as a plain str and every kernel calling it failed to compile (the router on CUDA, by default)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "kestrel"


def _jit_functions():
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                yield path, node


def test_the_scan_sees_the_kernels():
    names = {node.name for _, node in _jit_functions()}
    assert {"_summed_logits", "_slice_logits"} <= names  # the helpers the failure was in


def test_no_jit_function_has_a_string_default():
    found = []
    for path, node in _jit_functions():
        params = node.args.args[len(node.args.args) - len(node.args.defaults) :]
        for param, default in zip(params, node.args.defaults):
            if isinstance(default, ast.Constant) and isinstance(default.value, str):
                found.append(
                    f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name}({param.arg}={default.value!r})"
                )
    assert not found, "pass these at every call site instead of defaulting them:\n" + "\n".join(found)
