"""How many intra-op threads a run uses.

On a machine where other work runs, threads that wait by spinning fight the other processes for
the cores. Measured on the dates training step (benchmarks/RESULTS.md, "Contention"), 2 cores:
torch's default of 2 threads gives 25.7 steps/s alone but 5.6 with one other busy process; one
thread gives 21.7 alone and 21.8 loaded. So a run takes one thread unless its steps are big
enough for the split to pay, and ``--threads`` overrides the choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["MIN_FLOPS_PER_THREAD", "choose_threads", "count_flops", "usable_cores"]

# Below this many floating-point operations per forward pass, splitting an operation across
# threads costs more in hand-offs than it saves.
MIN_FLOPS_PER_THREAD = 2e9


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def count_flops(step: Callable[[], object]) -> int:
    """Floating-point operations of one call of ``step`` (forward only), leaving the random
    state as it was."""
    with torch.random.fork_rng(), FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def choose_threads(requested: int | None, flops: int, cores: int | None = None) -> tuple[int, str]:
    """(thread count, why) for a run whose forward pass takes ``flops`` operations per step.

    ``requested`` (``--threads``) wins when given, then the ``OMP_NUM_THREADS`` environment
    variable; otherwise one thread per :data:`MIN_FLOPS_PER_THREAD`, at least one and at most
    the usable cores.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads must be a positive int, got {requested!r}")
        return requested, "chosen with --threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]):
        return int(os.environ["OMP_NUM_THREADS"]), "from OMP_NUM_THREADS; --threads N overrides"
    cores = usable_cores() if cores is None else cores
    n = max(1, min(cores, int(flops // MIN_FLOPS_PER_THREAD)))
    size = f"{flops / 1e6:.0f} MFLOP per forward step"
    if n == 1:
        return 1, f"auto: {size} is too small to gain from more threads; --threads N overrides"
    return n, f"auto: {size} over {cores} usable cores; --threads N overrides"
