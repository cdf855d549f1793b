"""The ring: each rank sends to the next and receives from the previous, with torch.distributed.

Every exchange is posted with ``batch_isend_irecv`` (a send to the next rank and a receive from
the previous one, fused, which NCCL needs to avoid a deadlock on a ring) before the work on the
block in hand, and waited for after it, so communication overlaps computation. A failure of the
transport (a rank that stopped, a peer that did not answer within the process group's
``timeout``) is raised as :class:`RingError`, naming the rank, the step and the peer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Ring", "RingError", "bytes_sent", "reset_traffic"]

# Tags keep concurrent exchanges (key/value blocks, gradient blocks) apart; each tensor of a
# message gets its own tag below its kind's base.
KV_TAG = 1000
GRAD_TAG = 2000


_SENT = [0]  # bytes this process has sent to its ring neighbours


def bytes_sent() -> int:
    """Bytes this process has sent over ring exchanges since the last :func:`reset_traffic`
    (point-to-point payload only; the small agreement collectives are not counted)."""
    return _SENT[0]


def reset_traffic() -> None:
    """Start counting :func:`bytes_sent` from zero."""
    _SENT[0] = 0


class RingError(RuntimeError):
    """A ring exchange failed: a rank of the group stopped or did not answer in time."""


class Ring:
    """The ranks of ``group`` in a ring (group rank r sends to r+1 and receives from r−1)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))

    @classmethod
    def of(cls, group: object) -> Ring:
        """The ring of ``group`` (None: the default group), refused unless torch.distributed
        is initialised and this process is a member."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "ring attention needs torch.distributed: call "
                "torch.distributed.init_process_group (backend 'gloo' on CPU, 'nccl' on CUDA) "
                "on every rank first"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "group must be a torch.distributed ProcessGroup or None, got "
                f"{type(group).__name__}"
            )
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the group it "
                "passed; call ring attention only on the group's ranks"
            )
        return cls(group)

    def check_device(self, x: Tensor, name: str) -> None:
        """Refuse a tensor that the group's backend does not send (nccl: CUDA, gloo: CPU)."""
        backend = self.backend.lower()
        if backend == "nccl" and x.device.type != "cuda":
            raise ValueError(
                f"the group's backend is nccl, which sends CUDA tensors, but {name} is on "
                f"{x.device}; move the inputs to the GPU or use a gloo group"
            )
        if backend == "gloo" and x.device.type != "cpu":
            raise ValueError(
                f"the group's backend is gloo, which sends CPU tensors here, but {name} is on "
                f"{x.device}; use an nccl group for CUDA tensors"
            )

    def device_of(self, x: object) -> torch.device:
        """Where this ring's small messages about ``x`` are made: x's device when the backend
        sends it (nccl: CUDA, gloo: CPU), else the backend's own (a refused call still takes
        part in the agreement)."""
        wanted = "cuda" if self.backend.lower() == "nccl" else "cpu"
        if isinstance(x, Tensor) and x.device.type == wanted:
            return x.device
        if wanted == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a transport failure during ``what`` into a :class:`RingError`."""
        try:
            yield
        except RingError:
            raise
        except RuntimeError as err:
            raise RingError(
                f"ring attention on rank {self.rank} of {self.size}: {what} failed; a rank of "
                "the group has probably stopped, or did not answer within the process group's "
                "timeout (init_process_group(timeout=...) for the default group; "
                "new_group(timeout=...) or attnkit.distributed.ring_groups for a ring of its "
                f"own). Cause: {type(err).__name__}: {err}"
            ) from err

    def exchange(self, tensors: Sequence[Tensor], base_tag: int) -> tuple[list[Tensor], list]:
        """Post: send ``tensors`` to the next rank, receive the same shapes from the previous
        one. Returns (receive buffers, pending works); :meth:`wait` completes them."""
        if self.size == 1:
            return list(tensors), []
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = []
        for i, (t, b) in enumerate(zip(tensors, buffers, strict=True)):
            tag = base_tag + i
            ops.append(
                dist.P2POp(dist.isend, t.contiguous(), group=self.group, group_peer=nxt, tag=tag)
            )
            ops.append(dist.P2POp(dist.irecv, b, group=self.group, group_peer=prev, tag=tag))
        with self.guard(f"posting an exchange with ranks {prev} and {nxt}"):
            works = dist.batch_isend_irecv(ops)
        _SENT[0] += sum(t.numel() * t.element_size() for t in tensors)
        return buffers, works

    def wait(self, pending: tuple[list[Tensor], list], step: str) -> list[Tensor]:
        """The received tensors of an exchange posted by :meth:`exchange`."""
        buffers, works = pending
        prev = (self.rank - 1) % self.size
        with self.guard(f"{step}: receiving from rank {prev}"):
            for work in works:
                work.wait()
        return buffers

    def passes(self, block: Sequence[Tensor], what: str) -> Iterator[tuple[int, list[Tensor]]]:
        """One turn of the ring: yields (owner rank, block) for the block each rank holds at
        each of the P steps, starting with its own; the next block's exchange is posted before
        each yield. Stopping early still completes the turn (the other ranks wait for it)."""
        current = list(block)
        step = 0
        pending = None
        try:
            while step < self.size:
                pending = self.exchange(current, KV_TAG) if step < self.size - 1 else None
                yield (self.rank - step) % self.size, current
                if pending is not None:
                    current = self.wait(pending, f"{what}, step {step + 1}")
                    pending = None
                step += 1
        except GeneratorExit:
            # The consumer stopped early: forward the rest unread, the other ranks wait for it.
            if pending is not None:
                current = self.wait(pending, f"{what}, step {step + 1}")
                step += 1
            while step < self.size - 1:
                current = self.wait(self.exchange(current, KV_TAG), f"{what}, step {step + 1}")
                step += 1
            raise

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` is set on any rank (a collective: every rank calls it)."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        with self.guard("agreeing on another sweep over the keys"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def all_gather(self, row: Tensor, what: str) -> Tensor:
        """(P, L): every rank's ``row`` (L,), in group rank order."""
        if self.size == 1:
            return row[None]
        out = [torch.empty_like(row) for _ in range(self.size)]
        with self.guard(what):
            dist.all_gather(out, row, group=self.group)
        return torch.stack(out)
