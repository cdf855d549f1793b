"""This process's resident memory and its high-water mark, read from ``/proc`` (Linux).

What the memory benchmarks and a run's cost report rest on: the resident memory before a step
(``VmRSS``) and the highest it reached (``VmHWM``), after the high-water mark was reset to the
current size so that each step measures its own peak.

glibc keeps freed memory: a freed block above its ``mmap`` threshold raises that threshold (so
the next blocks of that size come from the heap and stay resident after ``free``), and the
heap is trimmed only above 128 KiB of free top. A step's resident peak then counts what earlier
steps left behind, not what the step holds live. A process started with :data:`LIVE_ALLOCATOR`
in its environment has a fixed ``mmap`` threshold of 64 KiB (every larger block is mapped on
allocation and unmapped on ``free``) and trims the heap at every ``free``, so the resident memory
follows the live memory; :func:`reset_peak` before a step then makes ``VmHWM`` that step's live
peak. The settings make allocation slower: use them for memory cells, never for timing.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

__all__ = ["LIVE_ALLOCATOR", "live_env", "live_peak", "reset_peak", "status"]

T = TypeVar("T")

#: glibc settings under which freed memory goes back to the system at once (read by glibc at
#: process start, so they must be in a new process's environment).
LIVE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def live_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with :data:`LIVE_ALLOCATOR` set, for a
    subprocess whose peak memory should be its live memory."""
    return {**(os.environ if env is None else env), **LIVE_ALLOCATOR}


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


def live_peak(call: Callable[[], T]) -> tuple[T, int | None]:
    """``call()``'s result and the bytes it added to the resident memory at its peak: the
    high-water mark reset (:func:`reset_peak`), ``VmHWM`` after the call less ``VmRSS`` before
    it (None where ``/proc`` or the reset is not there). In a process started with
    :func:`live_env` this is the call's live peak."""
    ok = reset_peak()
    before = status("VmRSS")
    out = call()
    peak = status("VmHWM") if ok else None
    return out, None if peak is None or before is None else peak - before
