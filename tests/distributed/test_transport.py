"""The ring's transport: refusals before any communication, failures named as RingError, the
traffic counter. Exchanges themselves run in the spawned workers of test_ring.py."""

from __future__ import annotations

import pytest
import torch

from attnkit.distributed import RingError
from attnkit.distributed.transport import Ring, bytes_sent, reset_traffic


def _ring(rank: int, size: int) -> Ring:
    ring = Ring.__new__(Ring)
    ring.rank, ring.size, ring.group, ring.backend = rank, size, None, "gloo"
    return ring


def test_a_ring_needs_an_initialised_process_group():
    with pytest.raises(ValueError, match="init_process_group"):
        Ring.of(None)


def test_transport_failures_become_ring_errors_naming_rank_and_timeout():
    ring = _ring(2, 4)
    failing = pytest.raises(RingError, match=r"rank 2 of 4: step 3 failed.*timeout")
    with failing as info, ring.guard("step 3"):
        raise RuntimeError("Connection closed by peer")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="not a transport error"), ring.guard("step 3"):
        raise ValueError("not a transport error")


def test_a_ring_of_one_sends_nothing():
    reset_traffic()
    ring = _ring(0, 1)
    x = torch.randn(3, 4)
    assert [owner for owner, _ in ring.passes([x], "a turn")] == [0]
    received, works = ring.exchange([x], 0)
    assert received[0] is x and works == []
    assert bytes_sent() == 0
    assert ring.any(True, x.device) and not ring.any(False, x.device)


def test_the_device_must_suit_the_backend():
    ring = _ring(0, 2)
    ring.backend = "nccl"
    with pytest.raises(ValueError, match="nccl, which sends CUDA tensors, but q is on cpu"):
        ring.check_device(torch.zeros(1), "q")
