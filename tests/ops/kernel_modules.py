"""The Triton kernel modules of the op tests, decorated in this process's mode. Without CUDA the kernels run under
TRITON_INTERPRET=1, which Triton reads when a kernel is decorated: importing this module sets it (before the test
file's first kernel import; tests/conftest.py sets it too), and `load_kernels` reloads a module that something
imported earlier."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def load_kernels(name: str) -> ModuleType:
    """The kernel module `name`, decorated in the mode chosen above even when something imported it earlier."""
    fresh = name not in sys.modules
    module = importlib.import_module(name)
    return module if fresh else importlib.reload(module)
