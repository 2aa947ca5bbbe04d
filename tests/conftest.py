"""Test-session setup. On a machine without CUDA, Triton kernels run in Triton's interpreter, which must be
switched on before Triton is first imported (its own standard-library functions are decorated at import):
several test modules import fla-core, which imports Triton, before the kernel tests are collected."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
