"""Shared benchmark plumbing: timing with torch.utils.benchmark and a machine description."""

from __future__ import annotations

import platform
import subprocess

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
