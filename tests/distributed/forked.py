"""A world of forked gloo processes for the tests of the ring forms: each rank runs a worker
function and writes what it checked and what failed to a file, read back by the test."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

TOL = 1e-10

# worker(rank, world, failures) -> the counts of what it checked
Worker = Callable[[int, int, list[str]], dict]


def _main(worker: Worker, rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    failures: list[str] = []
    checks: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(out, 'store')}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        checks = worker(rank, world, failures)
    except Exception:
        failures.append(traceback.format_exc())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"checks": checks, "failures": failures}))
    os._exit(0)


def run_world(worker: Worker, world: int, out: Path, limit: float = 300.0) -> list[dict]:
    """Each rank's report ({"checks": …, "failures": […]}) after ``worker`` ran on a world of
    ``world`` forked processes (a FileStore in ``out``); a rank that wrote none reports that."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_main, args=(worker, r, world, str(out))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    reports = []
    for r in range(world):
        path = out / f"rank{r}.json"
        if path.exists():
            reports.append(json.loads(path.read_text()))
        else:
            reports.append({"checks": {}, "failures": [f"rank {r} wrote no report"]})
    return reports


def failures_of(reports: list[dict]) -> str:
    return "\n".join(f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"])


def compare(got: Tensor, want: Tensor, what: str, failures: list[str], tol: float = TOL):
    err = float((got - want).abs().max())
    if not err <= tol:  # also NaN
        failures.append(f"{what} differs by {err:.3g}")


def rings(rank: int, world: int) -> list[tuple[int, dist.ProcessGroup | None]]:
    """The rings this rank is in: (2, a group of ranks 0-1) and (world, None), made by every
    rank (``new_group`` is collective over the world)."""
    two = dist.new_group([0, 1])
    out = [(2, two)] if rank < 2 else []
    return [*out, (world, None)]
