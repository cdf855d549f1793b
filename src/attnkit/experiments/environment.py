"""What a run ran on, written to ``environment.json`` and shown in the report: the versions of
attnkit, torch and Python, the command line, the machine (processor, cores, threads used,
operating system) and the wall time, so that a number in a report can be reproduced and its
cost compared with another machine's.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import attnkit

__all__ = ["FIELDS", "collect", "command_line", "processor", "rows"]

# What each field means, in the order the report shows them.
FIELDS: dict[str, str] = {
    "command": "command line",
    "attnkit": "attnkit version",
    "torch": "PyTorch version",
    "python": "Python version",
    "wall_seconds": "wall time of this invocation, training + evaluation",
    "train_seconds": "of which training",
    "processor": "processor",
    "cpu_cores": "logical CPU cores of the machine",
    "threads": "threads used by each process",
    "processes": "processes (data-parallel ranks)",
    "device": "device the model ran on",
    "os": "operating system",
    "finished": "finished at (local time)",
}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process (``sys.argv`` by default) as one shell line, the
    program named without its directory: ``attnkit run --task copy``; ``python -m attnkit ...``
    for the module form."""
    args = [str(a) for a in (sys.argv if argv is None else argv)]
    if not args:
        return ""
    program = Path(args[0])
    name = program.name
    if name == "__main__.py" and program.parent.name == "attnkit":
        name = "python -m attnkit"
    elif name == "-c":
        name = "python -c"
    elif name.endswith(".py"):
        name = f"python {name}"
    return " ".join([name, shlex.join(args[1:])]) if args[1:] else name


def _cpuinfo_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


def _lscpu_model() -> str | None:
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=5, check=False,
            env={**os.environ, "LC_ALL": "C"},
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and value.strip():
            return value.strip()
    return None


def processor() -> str:
    """The processor's model name (``/proc/cpuinfo``, else ``lscpu``, else what Python's
    ``platform`` knows), "unknown" when none says."""
    return (
        _cpuinfo_model()
        or _lscpu_model()
        or platform.processor()
        or platform.machine()
        or "unknown"
    )


def collect(
    *,
    threads: int,
    processes: int = 1,
    wall_seconds: float | None = None,
    train_seconds: float | None = None,
    device: str = "cpu",
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The environment of a run, keyed as :data:`FIELDS`: ``threads`` per process, the number
    of data-parallel ``processes``, the wall time of training + evaluation and of training
    alone (seconds), the ``device`` of the model and the command line (``argv``, by default
    this process's)."""
    return {
        "command": command_line(argv),
        "attnkit": attnkit.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "wall_seconds": wall_seconds,
        "train_seconds": train_seconds,
        "processor": processor(),
        "cpu_cores": os.cpu_count(),
        "threads": threads,
        "processes": processes,
        "device": device,
        "os": platform.platform(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(value, 60)
    if minutes < 60:
        return f"{value:.0f} s ({int(minutes)} min {seconds:.0f} s)"
    hours, minutes = divmod(minutes, 60)
    return f"{value:.0f} s ({int(hours)} h {int(minutes)} min)"


def rows(environment: Mapping[str, Any]) -> list[list[str]]:
    """[meaning, value] rows for the report: the known fields in :data:`FIELDS` order, times in
    seconds (and minutes when long), then any other keys as they are."""
    out = []
    names = [k for k in FIELDS if k in environment] + [k for k in environment if k not in FIELDS]
    for name in names:
        value = environment[name]
        if value is None:
            text = "-"
        elif name.endswith("_seconds") and isinstance(value, int | float):
            text = _seconds(float(value))
        else:
            text = str(value)
        out.append([FIELDS.get(name, name), text])
    return out
