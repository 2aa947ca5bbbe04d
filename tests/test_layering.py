"""Imports point downward only: config/env/utils -> ops -> layers -> models -> cache -> engine -> serve | rl | bench.
`serve` and `rl` never import each other. Checked on the AST of every module."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kestrel"
# Lower number = lower layer. A module may import its own level or below.
LEVEL = {
    "version": 0,
    "env": 0,
    "config": 0,
    "presets": 0,
    "utils": 0,
    "tokenizer": 0,
    "chat_template": 0,
    "grammar": 0,
    "detokenize": 0,
    "ops": 1,
    "layers": 2,
    "models": 3,
    "cache": 4,
    "dist": 4,
    "engine": 5,
    "train": 6,
    "serve": 7,
    "rl": 7,
    "bench": 7,
    "__init__": 8,
}
FORBIDDEN_PAIRS = {("serve", "rl"), ("rl", "serve")}


def _top(module_path: Path) -> str:
    rel = module_path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_every_top_level_part_has_a_level():
    parts = {_top(p) for p in PKG.rglob("*.py")}
    assert parts <= set(LEVEL), f"give these a level in tests/test_layering.py: {parts - set(LEVEL)}"


def test_imports_point_downward():
    bad = []
    for path in PKG.rglob("*.py"):
        src = _top(path)
        tree = ast.parse(path.read_text())
        # imports under `if TYPE_CHECKING:` are type references, allowed upward
        type_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in type_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imports(ast.Module(body=[node], type_ignores=[])):
                if not name.startswith("kestrel."):
                    continue
                dst = name.split(".")[1]
                if (src, dst) in FORBIDDEN_PAIRS or LEVEL.get(dst, 99) > LEVEL[src]:
                    bad.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_env_is_read_in_one_place():
    offenders = [
        str(p.relative_to(PKG.parent))
        for p in PKG.rglob("*.py")
        if p.name != "env.py" and ("os.environ" in p.read_text() or "os.getenv" in p.read_text())
    ]
    assert not offenders, f"read environment variables through kestrel.env, not in {offenders}"
