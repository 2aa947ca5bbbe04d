"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and later).

Without it, a kernel on a stream starts only once the kernel before it has finished: each boundary costs the
launch of the next grid and its programs' ramp-up, with the SMs idle while the last wave of the previous
kernel drains. With PDL the next kernel is launched as soon as every program of the current one has started
(`gdc_launch_dependents`, the first thing each program does), its programs wait at `gdc_wait` until the
current kernel has finished and its writes are visible, then run. A decode step is hundreds of such
boundaries (474 kernels a step on `mini`).

The rule that keeps this correct: every kernel launched with PDL calls `pdl_begin(PDL)` before it reads or
writes any memory another kernel touches. The wait covers the whole chain: the kernel waited for had itself
waited for its predecessor before finishing. Kernels without PDL (cuBLAS, torch's own) launch as before, after
the previous kernel has finished; a PDL kernel after one of them starts when it ends. The CUDA top-k
(kestrel.ops.dsa.cuda_topk) keeps the same rule with the same switch: its launch takes the programmatic
attribute where `pdl_args` is on, and its kernel lets the next launch, then waits, before its first read.

Measured on the H200 (2026-12-01, session 23, scripts/decode_kernels_check.py --sections pdl): a chain of 200
dependent kernels (RMSNorm, sigmoid gate) at width 2048 in one CUDA graph, us a kernel without / with PDL:
batch 1 1.60 / 0.93, 64 1.79 / 1.17, 256 1.99 / 1.87, the same bits. mini's decode step (`bench decode`, graph
replay, 4K): batch 1 1.97 -> 1.84 ms, batch 64 4.12 / 4.14, batch 256 6.61 / 6.58 (its kernels are long: the
ramp-up saved is small beside them).

On other devices (the CPU, Triton's interpreter, GPUs before compute capability 9.0, ROCm, a Triton without
`launch_pdl`) or with KESTREL_PDL=off, `pdl_args` is empty and the kernels compile without the two
instructions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.env import env_field

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: never enabled (see `_supported`)
    gdc_launch_dependents = gdc_wait = None

_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}
_devices: dict[int, bool] = {}  # device index -> PDL works there


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """The first statement of a kernel launched with `pdl_args`: let the next kernel launch (its programs
    take the SMs this kernel's last wave leaves free), then wait until the previous kernel has finished."""
    pdl_launch_next(PDL)
    pdl_wait(PDL)


@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    """`pdl_begin`'s first half, for a kernel with work to do before the wait (`l2_prefetch`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """`pdl_begin`'s second half: nothing another kernel writes may be read or written before it."""
    if PDL:
        gdc_wait()


@triton.jit
def l2_prefetch(ptrs, nbytes):
    """Ask for `nbytes` from each address of `ptrs` into L2 (a bulk prefetch each, sm_90+; nbytes and the
    addresses multiples of 16) without waiting for them. Between `pdl_launch_next` and `pdl_wait`: memory no
    kernel writes (weights) streams in while the kernel before ends. Compiled only on such GPUs (the CPU
    interpreter has no inline assembly): call it under a constexpr that `pdl_args` set."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, tl.zeros(ptrs.shape, tl.int32) + nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def _supported(index: int) -> bool:
    if gdc_wait is None or env_field("triton_interpret") or torch.version.hip is not None:
        return False  # ROCm reports compute capabilities >= 9 too, without griddepcontrol
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(t: torch.Tensor) -> dict:
    """The launch arguments that turn PDL on for a kernel working on t's device ({"PDL": True,
    "launch_pdl": True}), or {} where it is off (see the module docstring)."""
    return _ON if pdl_on(t.device) else _OFF


def pdl_on(device: torch.device) -> bool:
    """PDL is on for kernels on `device` (a Hopper or later GPU, KESTREL_PDL not off; see the module docstring)."""
    if device.type != "cuda" or env_field("pdl") == "off":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = _devices.get(index)
    if on is None:
        on = _devices[index] = _supported(index)
    return on
