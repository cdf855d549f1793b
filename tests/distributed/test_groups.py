"""ring_groups: every ring's group waits the run's timeout, not torch's 30-minute default for new
groups. Three gloo processes (forked, 127.0.0.1, a FileStore in tmp_path) form one ring with a
5 s timeout while the world's default group waits 120 s; one rank stops itself (SIGSTOP, as a
hung data loader) and the others must end with a RingError whose cause is the 5 s timeout. Every
process is bounded: the test fails, not hangs, when a rank keeps waiting, and the stopped rank
is killed (SIGKILL) at the end."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnkit.distributed import RingError, ring_attention, ring_groups

WORLD = 3
STOPPED = 2
RING_TIMEOUT = 5.0  # seconds: the ring's group
WORLD_TIMEOUT = 120.0  # seconds: the default group, far longer, so it cannot be the one that fires
# how long the test waits for the ranks at most: a guard against a hang only. Which timeout
# fired is read from gloo's message (the ring's 5 s, not the world's 120 s), not from a clock.
GUARD = WORLD_TIMEOUT + 60.0


def _stalling_rank(rank: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1 only
    torch.set_num_threads(1)
    report: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=WORLD_TIMEOUT),
        )
        group = ring_groups(WORLD, timeout=RING_TIMEOUT)
        x = torch.randn(1, 4, 2, dtype=torch.float64)
        ring_attention(x, x, x, group=group)  # the ring works before the stall
        dist.barrier()  # every rank is past its first call
        if rank == STOPPED:
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            ring_attention(x, x, x, group=group)
            report["error"] = None
        except RingError as err:
            report["error"] = str(err)
    except Exception:
        report["crash"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no process-group teardown: a peer is stopped


def test_a_stopped_rank_ends_the_others_within_the_ring_timeout(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_stalling_rank, args=(r, str(tmp_path / "store"), str(tmp_path)))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + GUARD
        for r, p in enumerate(procs):
            if r != STOPPED:
                p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # the stopped rank, and any that still waits
            p.join(10)
    for r in range(WORLD):
        if r == STOPPED:
            continue
        written = tmp_path / f"rank{r}.json"
        assert written.exists(), f"rank {r} kept waiting for the stopped rank {STOPPED}"
        report = json.loads(written.read_text())
        assert "crash" not in report, report["crash"]
        message = report["error"]
        assert message is not None, f"rank {r} finished although rank {STOPPED} was stopped"
        assert f"rank {r} of {WORLD}" in message
        # gloo names the timeout that fired: the ring's 5 s, not the world's 120 s
        assert f"{int(RING_TIMEOUT * 1000)}ms" in message, message


def test_arguments_are_checked_before_any_group_is_made():
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        ring_groups(0, timeout=5)
    with pytest.raises(TypeError, match=r"timeout must be seconds .* got str"):
        ring_groups(2, timeout="5")
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        ring_groups(2, timeout=datetime.timedelta(seconds=0))
    with pytest.raises(ValueError, match="init_process_group"):
        ring_groups(2, timeout=5)
