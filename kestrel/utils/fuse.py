"""`fused_in_training`: an op that runs as written, or through torch.compile while autograd records
(training) when KESTREL_COMPILE_TRAIN is on. The ops it wraps are chains of fp32 elementwise work (norms, gates,
activations, AttnRes mixing) that eager PyTorch runs as one kernel, and one pass over memory, per operator,
forward and backward; compiled, each chain is one kernel each way. Inference keeps the eager op (its shapes
change every step, and decode runs in CUDA graphs already)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kestrel.env import read_env

_RECOMPILE_LIMIT = 64  # one compiled graph per (shape, dtype) an op meets: a model has a few dozen


def fused_in_training(fn: Callable) -> Callable:
    compiled = None

    @functools.wraps(fn)
    def op(*args, **kwargs):
        nonlocal compiled
        if not torch.is_grad_enabled() or not read_env().compile_train:
            return fn(*args, **kwargs)
        if compiled is None:
            _raise_recompile_limit()
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        return compiled(*args, **kwargs)

    op.eager = fn  # the op as written (the reference the compiled one is tested against)
    return op


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
