"""Resolving `--device` and `--dtype` values."""

from __future__ import annotations

import torch

from kestrel.utils.errors import KestrelError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KestrelError(f"--device {name!r}: not a device (use auto, cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise KestrelError(f"--device {name!r}: not supported (use auto, cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KestrelError(f"--device {name}: CUDA is not available on this machine")
        if (device.index or 0) >= torch.cuda.device_count():
            raise KestrelError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, so the copy does not wait for the stream (a
    copy from pageable memory synchronizes with it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A device tensor's copy in pinned host memory, queued behind the work launched so far without waiting for
    it, and the event that marks the copy done (synchronize it before reading the copy); on the CPU the tensor
    itself and None."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise KestrelError(f"--dtype {name!r}: expected auto, float32, bfloat16 or float16")
    return getattr(torch, name)
