"""`fused`: an op that runs as written (its plain-torch reference), or faster where that is safe:

- while autograd records (training) with KESTREL_COMPILE_TRAIN on (auto: on CUDA): through torch.compile, so
  that the chain of fp32 elementwise work (norms, gates, activations, AttnRes mixing), one kernel and one pass
  over memory per operator in eager PyTorch, is one kernel forward and one backward;
- without autograd (inference: the engine runs under no_grad) on CUDA, below fp64, when the op names a `fast`
  Triton kernel and KESTREL_FUSED_OPS is auto: through that kernel. Decode is bound by the number of kernels a step
  launches, and these ops are most of them.

The reference stays as `op.eager`; the fast kernels are tested against it."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

import torch

from kestrel.env import env_field, fused_ops_on

_RECOMPILE_LIMIT = 64  # one compiled graph per (shape, dtype) an op meets: a model has a few dozen


def fused(fast: str | None = None) -> Callable[[Callable], Callable]:
    """Decorate a reference op; `fast` is "module:function", imported on first use (so that the reference
    imports no Triton), with the op's own signature."""

    def wrap(fn: Callable) -> Callable:
        first = next(iter(inspect.signature(fn).parameters))  # the argument that picks the path

        @functools.wraps(fn)
        def op(*args, **kwargs):
            x = args[0] if args else kwargs.get(first)  # passed by keyword too
            if records(*args, *kwargs.values()):
                return for_training(fn, x)(*args, **kwargs)
            if fast is not None and fast_applies(x):
                return _resolve(fast)(*args, **kwargs)
            return fn(*args, **kwargs)

        op.eager = fn  # the op as written (the reference the compiled and Triton ones are tested against)
        op.fast = (lambda: _resolve(fast)) if fast is not None else None
        return op

    return wrap


def fast_applies(x) -> bool:
    """An inference op on x (the argument that picks the path) runs its one-kernel Triton form: x a CUDA tensor,
    not fp64, and KESTREL_FUSED_OPS at auto."""
    return isinstance(x, torch.Tensor) and x.is_cuda and x.dtype != torch.float64 and fused_ops_on()


def for_training(fn: Callable, x) -> Callable:
    """fn as training runs it on x (the argument that picks the path): compiled where KESTREL_COMPILE_TRAIN is on,
    or auto and x is a CUDA tensor; as written otherwise. `fused` ops use it while autograd records; an
    autograd.Function calls it for the pieces of its forward and backward, which autograd does not record."""
    mode = env_field("compile_train")
    if mode == "on" or (mode == "auto" and isinstance(x, torch.Tensor) and x.is_cuda):
        return compiled(fn)
    return fn


@functools.cache
def compiled(fn: Callable) -> Callable:
    """fn through torch.compile, once per function (static shapes: one graph per shape it meets, up to the raised
    recompile limit)."""
    raise_recompile_limit()
    return torch.compile(fn, dynamic=False, fullgraph=True)


def records(*args) -> bool:
    """Whether autograd records a call on these arguments: grad mode on and a tensor among them that requires
    grad (a forward without no_grad over frozen inputs takes the inference path)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


@functools.cache
def _resolve(spec: str) -> Callable:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
