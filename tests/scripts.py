"""Import one of the repository's scripts (scripts/*.py, which are not a package) as a module, for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """scripts/<name>.py as a fresh module named `module_name` (default: name), registered in sys.modules while
    it runs (dataclasses look their module up there)."""
    module_name = module_name or name
    spec = importlib.util.spec_from_file_location(module_name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del sys.modules[module_name]
        else:
            sys.modules[module_name] = previous
    return module
