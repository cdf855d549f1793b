"""Timing with torch.utils.benchmark, peak memory in a fresh subprocess, machine description."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import torch
from torch.utils import benchmark


def median_seconds(fn, *, min_run_time: float = 2.0) -> float:
    """Median wall time of ``fn()`` after a warm-up call (torch.utils.benchmark)."""
    fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


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


def in_subprocess(case: dict, timeout: float = 3600) -> dict:
    """Run one benchmark case (see :mod:`attnkit.benchmarking.worker`) in a fresh Python, so
    that its peak resident memory is its own. Returns the worker's JSON result, or
    ``{"error": ...}`` when it failed (e.g. ran out of memory)."""
    proc = subprocess.run(
        [sys.executable, "-m", "attnkit.benchmarking.worker", json.dumps(case)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])
