"""transformers' Kimi-Linear with its pure-torch paths, the reference nobody here wrote.

transformers binds `chunk_kda`/`fused_recurrent_kda` to fla-core when fla imports, and fla's Triton kernels
cannot run on a CPU; so the modeling module is (re)loaded with fla hidden, which selects the torch paths.
"""

from __future__ import annotations

import importlib
import sys


def torch_only_kimi_linear():
    hidden = {name: mod for name, mod in sys.modules.items() if name == "fla" or name.startswith("fla.")}
    for name in hidden:
        del sys.modules[name]
    sys.modules["fla"] = None  # any `import fla` now fails
    try:
        module = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
        module = importlib.reload(module)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)
    return module
