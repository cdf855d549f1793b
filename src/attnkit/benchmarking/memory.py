"""This process's resident memory and its high-water mark, read from ``/proc`` (Linux).

What the memory benchmarks and a run's cost report rest on: the resident memory before a step
(``VmRSS``) and the highest it reached (``VmHWM``), after the high-water mark was reset to the
current size so that each step measures its own peak.
"""

from __future__ import annotations

import ctypes
import gc
from contextlib import suppress

__all__ = ["reset_peak", "status"]


def status(field: str) -> int | None:
    """A ``/proc/self/status`` memory field (``"VmRSS"``, ``"VmHWM"``) in bytes, or None where
    ``/proc`` is not there."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Collect garbage, give freed heap memory back to the system (glibc's ``malloc_trim``) and
    reset the high-water mark to the current resident memory (``/proc/self/clear_refs``, Linux
    ≥ 4.0); True when the reset took effect."""
    gc.collect()
    with suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return status("VmHWM") is not None
