"""How many programs of a compiled Triton kernel one SM holds at once: what a kernel whose grid is one wave (the
one-launch MoE's grid barriers, the indexer scores' work list) sizes its grid by."""

from __future__ import annotations

import torch


def programs_an_sm(compiled, warps: int, device: torch.device) -> int:
    """The programs of `compiled` (a Triton CompiledKernel of `warps` warps) one SM of `device` holds at once: by
    its registers (allocated per warp in blocks of 256), threads, shared memory (1 KB a block reserved) and the
    32 blocks an SM takes."""
    compiled._init_handles()  # loads the binary: n_regs is read from it
    props = torch.cuda.get_device_properties(device)
    regs_a_warp = -(-compiled.n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs_a_warp * warps)
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_shared = props.shared_memory_per_multiprocessor // (compiled.metadata.shared + 1024)
    return min(by_regs, by_threads, by_shared, 32)
