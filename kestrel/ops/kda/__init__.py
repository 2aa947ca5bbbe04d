"""KDA ops: plain-torch references and a small backend registry (naive everywhere, fla-core on CUDA; its decode
step on the state slots is our Triton kernel, kestrel.ops.kda.triton_recurrent, unless KESTREL_KDA_DECODE=fla).

A backend provides `chunk` (prefill) and `recurrent` (decode) with the signatures of `naive.chunk_kda`
(minus chunk_size) and `naive.recurrent_kda`; `chunk` and `short_conv` take the host copy of cu_seqlens
(`cu_seqlens_cpu`) where the caller has one, so that no backend reads the layout back from the device.
KESTREL_KDA_BACKEND picks one (see kestrel.env).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kestrel.env import env_field
from kestrel.ops.kda import naive
from kestrel.ops.kda.naive import (
    chunk_kda,
    gated_rms_norm,
    kda_gate,
    l2norm,
    recurrent_kda,
    short_conv,
    short_conv_step,
)
from kestrel.utils.errors import ConfigError

# Up to this many sequences (the GEMV's rows, `kestrel.ops.linear.GEMV_MAX_ROWS`) the KDA layer's decode hands the
# recurrence f_b's weight (`recurrent_inplace(f_b=)`) instead of projecting f_a itself: each program of our Triton
# step multiplies its head's [K, K_f] slice of f_b by f_a, loading the slice before its PDL wait, and the GEMV's
# launch is gone (18 a step on mini). mini's replayed step at 4K on the H200 with / without (session 44): batch 1
# 1.396-1.398 / 1.422 ms, 4 1.890-1.900 / 1.925, 8 2.210-2.213 / 2.228-2.242, 16 2.617-2.622 / 2.631-2.643.
F_B_MAX_ROWS = 16

__all__ = [
    "F_B_MAX_ROWS",
    "KDABackend",
    "chunk_kda",
    "gated_rms_norm",
    "get_kda_backend",
    "kda_gate",
    "l2norm",
    "recurrent_kda",
    "short_conv",
    "short_conv_step",
]


@dataclass(frozen=True)
class KDABackend:
    name: str
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    recurrent_inplace: Callable[..., torch.Tensor]  # decode on the state slots themselves
    conv_step_inplace: Callable[..., torch.Tensor]
    short_conv: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # prefill conv over packed sequences


NAIVE = KDABackend(
    "naive", chunk_kda, recurrent_kda, naive.recurrent_inplace, naive.conv_step_inplace, short_conv
)


def _short_conv_auto(x, weight, conv_state=None, cu_seqlens=None, planes=1, cu_seqlens_cpu=None):
    """KESTREL_KDA_CONV=auto: while autograd records, fla-core's varlen causal_conv1d on CUDA (Triton forward
    and backward) and the packed torch form elsewhere; else our Triton inference kernel. In a demo training
    step (8 x 8704 tokens, H200) fla's backward took 4.8 ms where the packed form's gathers, index_add and
    reductions took ~50 ms: steps of 0.169 vs 0.240 s (session 11)."""
    from kestrel.ops.kda.packed_conv import short_conv_packed
    from kestrel.ops.kda.triton_conv import short_conv_prefill

    inputs = (x, weight) if conv_state is None else (x, weight, conv_state)
    if x.dtype == torch.float64:  # the kernels compute in fp32
        return short_conv_packed(x, weight, conv_state, cu_seqlens, planes)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        if x.is_cuda:
            from kestrel.ops.kda import fla

            return fla.short_conv(x, weight, conv_state, cu_seqlens, planes, cu_seqlens_cpu)
        return short_conv_packed(x, weight, conv_state, cu_seqlens, planes)
    return short_conv_prefill(x, weight, conv_state, cu_seqlens, planes=planes)


def _fla_backend() -> KDABackend:
    from kestrel.ops.kda import fla, triton_recurrent  # fla imports fla-core and triton
    from kestrel.ops.kda.packed_conv import short_conv_packed

    choice = env_field("kda_conv")
    conv = {"fla": fla.short_conv, "torch": short_conv_packed}.get(choice, _short_conv_auto)
    step = fla.recurrent_inplace if env_field("kda_decode") == "fla" else triton_recurrent.recurrent_inplace
    return KDABackend("fla", fla.chunk, fla.recurrent, step, fla.conv_step_inplace, conv)


def get_kda_backend(device: torch.device) -> KDABackend:
    """The KDA backend for tensors on `device`, as KESTREL_KDA_BACKEND (auto | naive | fla) asks."""
    device = torch.device(device)
    choice = env_field("kda_backend")  # every KDA layer asks at every step: its variables alone
    if choice == "naive":
        return NAIVE
    if choice == "fla":
        if device.type != "cuda" and not env_field("triton_interpret"):
            raise ConfigError(
                f"KESTREL_KDA_BACKEND=fla needs a CUDA device, but the model is on {device}; "
                "use KESTREL_KDA_BACKEND=naive or auto"
            )
        try:
            return _fla_backend()
        except ImportError as e:
            raise ConfigError(
                f"KESTREL_KDA_BACKEND=fla but fla-core / triton cannot be imported ({e}); "
                "install fla-core>=0.6.0 and triton, or use KESTREL_KDA_BACKEND=naive"
            ) from e
    if device.type == "cuda":
        try:
            return _fla_backend()
        except ImportError:
            pass
    return NAIVE
