"""What a run costs: training wall time and the peak resident memory that training added.

The peak is the process's resident high-water mark (Linux ``VmHWM``) while training, minus the
resident memory when training started (the interpreter, torch, the data and the model are the
base). Before training, freed memory is handed back to the system (``malloc_trim``) and the
high-water mark is reset (``/proc/self/clear_refs``), so that runs one after another in one
process (``--compare``) each measure their own peak. Where the reset is not possible the peak is
the process's lifetime maximum (``ru_maxrss``) and says so (``peak_is_lifetime``).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

from attnkit.benchmarking.memory import reset_peak as _reset_peak
from attnkit.benchmarking.memory import status as _status
from attnkit.tasks.base import Metric

__all__ = ["METRICS", "measure"]

METRICS: dict[str, Metric] = {
    "train_seconds": Metric("training wall time, seconds, on the machine of the run", "lower"),
    "train_peak_mib": Metric(
        "peak resident memory added by training, MiB (above the data and model)", "lower"
    ),
}


@contextmanager
def measure() -> Iterator[dict]:
    """``with measure() as cost: train()`` fills ``cost`` with ``train_seconds``,
    ``train_peak_mib`` and ``peak_is_lifetime``."""
    cost: dict = {}
    reset = _reset_peak()
    base = _status("VmRSS") if reset else None
    start = time.perf_counter()
    try:
        yield cost
    finally:
        cost["train_seconds"] = time.perf_counter() - start
        if reset and base is not None:
            peak = _status("VmHWM") or base
            cost["peak_is_lifetime"] = False
        else:
            peak, base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0
            cost["peak_is_lifetime"] = True
        cost["train_peak_mib"] = max(peak - base, 0) / 2**20
