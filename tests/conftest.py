"""Test-session setup. On a machine without CUDA, Triton kernels run in Triton's interpreter, which must be
switched on before Triton is first imported (its own standard-library functions are decorated at import):
several test modules import fla-core, which imports Triton, before the kernel tests are collected. The child
processes of tests marked `early` start when collection ends, beside the rest of the suite (tests/early.py)."""

from __future__ import annotations

import os

import torch

from tests import early

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session) -> None:
    if not session.config.option.collectonly:
        early.start_selected(session.items)


def pytest_sessionfinish(session, exitstatus) -> None:
    early.kill_all()
