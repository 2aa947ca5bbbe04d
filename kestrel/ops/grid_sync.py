"""A barrier across one persistent launch's programs, as a counter in global memory: the one-launch MoE
(kestrel.ops.moe.triton_decode) waits at two between its phases, the GEMV chain (kestrel.ops.linear.triton_chain)
at one a stage. It holds only where every program of the grid is resident at once; a wait past MAX_SPIN polls
gives up and raises a flag instead of hanging, and the launcher reads it. Split in two so a program can issue
work that needs nothing from the others (L2 requests for the weights ahead) between its arrival and its wait.
Triton's CPU interpreter runs a program to its end before the next starts: there a barrier opens only with one
program.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grid_arrive(counter):
    """Arrive at the barrier `counter` (an int32 in global memory, zero before the first program arrives) once
    every thread of this program has stored: returns how many programs have arrived, this one included. acq_rel:
    the last to arrive reads every count from its own add and must see the others' stores."""
    tl.debug_barrier()  # this program's threads have all stored
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1


@triton.jit
def grid_wait(counter, arrived, nprog, gave_up, MAX_SPIN: tl.constexpr):
    """Wait until nprog programs have arrived at `counter` (`arrived`: grid_arrive's count); every store before
    their arrivals is then visible here (acquire polls). After MAX_SPIN polls it gives up: sets the int32 at
    `gave_up` (the results are wrong) and goes on. Polled by plain volatile loads instead, then one acquiring
    atomic or a fence, the MoE layer was slower: 19.98 / 20.44 against 17.40 us (session 43)."""
    spins = 0
    while (arrived < nprog) & (spins < MAX_SPIN):
        arrived = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        spins += 1
    if arrived < nprog:
        tl.atomic_xchg(gave_up, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()
