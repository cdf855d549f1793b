"""Timing with torch.utils.benchmark, peak memory in a fresh subprocess, machine description."""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch.utils import benchmark

__all__ = [
    "in_subprocess",
    "interleaved",
    "machine",
    "measure_step",
    "median_seconds",
    "peak_rss",
]


def median_seconds(fn, *, min_run_time: float = 2.0) -> float:
    """Median wall time of ``fn()`` after a warm-up call (torch.utils.benchmark)."""
    fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall seconds of each of ``calls`` over ``repeats`` rounds, the calls interleaved and each
    first in turn (round r starts at the r-th call), so that a drift of the machine's load
    falls on all of them alike; round r's times are the r-th entries of the lists."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for r in range(repeats):
        shift = r % len(order)
        for k in order[shift:] + order[:shift]:
            start = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - start)
    return times


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in lscpu.splitlines()
                if line.startswith("Model name")
            ),
            platform.processor(),
        )
    except OSError:
        model = platform.processor()
    return (
        f"{model}; {torch.get_num_threads()} threads; torch {torch.__version__}; "
        f"Python {platform.python_version()}"
    )


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_step(step: Callable[[], object], repeats: int = 3) -> dict:
    """Run ``step`` once (warm-up, and the peak) and then ``repeats`` times: ``seconds`` (the
    median), ``peak_bytes`` (the process's peak resident memory) and ``base_bytes`` (that peak
    before the first call: interpreter, torch, inputs)."""
    base = peak_rss()
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"seconds": times[len(times) // 2], "peak_bytes": peak_rss(), "base_bytes": base}


def in_subprocess(
    case: dict, timeout: float = 3600, module: str = "attnkit.benchmarking.worker"
) -> dict:
    """Run one benchmark case (``python -m module '<json>'``, by default
    :mod:`attnkit.benchmarking.worker`) in a fresh Python, so that its peak resident memory is
    its own. Returns the module's JSON result, or ``{"error": ...}`` when it failed (e.g. ran
    out of memory) or ran past ``timeout`` seconds."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, json.dumps(case)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout:.0f} s limit"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:200]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])
