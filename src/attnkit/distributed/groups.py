"""The process groups of the rings: the world's ranks cut into rings of consecutive ranks, each
group made with the run's timeout.

``torch.distributed.new_group`` does not inherit the default group's timeout: without
``timeout=`` a new group waits torch's own default (30 minutes) for a peer, so a rank that hangs
(stopped, a stuck data loader) would hold the other ranks of its ring that long, whatever
``init_process_group(timeout=...)`` said. :func:`ring_groups` passes the timeout to every group
it makes.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

__all__ = ["ring_groups"]


def ring_groups(size: int, *, timeout: float | datetime.timedelta) -> dist.ProcessGroup:
    """This rank's ring when the world is cut into rings of ``size`` consecutive ranks.

    Ring r holds ranks r·size … r·size + size − 1 (data-parallel replicas × context-parallel
    ranks). Every rank of the world must call it, in the same order as its other group
    creations: ``torch.distributed.new_group`` is collective over the whole world.

    Args:
        size: the number of ranks of a ring; it must divide the world size.
        timeout: how long a rank of a ring waits for the others (seconds > 0 or a
            ``datetime.timedelta``) before its call fails; a ring attention call then raises
            :class:`attnkit.distributed.RingError`.

    Returns:
        The process group of this rank's ring.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int, got {size!r}")
    wait = _timeout(timeout)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "ring_groups needs torch.distributed: call torch.distributed.init_process_group on "
            "every rank first"
        )
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"size {size} does not divide the world of {world} processes")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)), timeout=wait)
        if start <= rank < start + size:
            mine = group
    assert mine is not None  # every rank lies in one ring
    return mine


def _timeout(timeout: object) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got "
            f"{type(timeout).__name__}"
        )
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return datetime.timedelta(seconds=seconds)
