"""Sequence layouts over a ring: which positions each rank holds, shard/unshard, refusals."""

from __future__ import annotations

import pytest
import torch

from attnkit.distributed import shard, unshard
from attnkit.distributed.layout import segments


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r(world):
    chunk = 3
    x = torch.arange(2 * world * chunk)
    for rank in range(world):
        front = list(range(rank * chunk, (rank + 1) * chunk))
        back_chunk = 2 * world - 1 - rank
        back = list(range(back_chunk * chunk, (back_chunk + 1) * chunk))
        assert shard(x, rank, world, layout="zigzag", dim=0).tolist() == front + back


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_unshard_inverts_shard_and_every_position_is_held_once(layout, world):
    x = torch.randn(2, 3, 24, 5)
    parts = [shard(x, r, world, layout=layout) for r in range(world)]
    assert torch.equal(unshard(parts, layout=layout), x)
    held = sorted(
        p
        for r in range(world)
        for s in segments(r, world, 24 // world, layout)
        for p in range(s.start, s.stop)
    )
    assert held == list(range(24))


def test_contiguous_parts_are_consecutive_blocks():
    x = torch.arange(12)
    assert shard(x, 1, 3, dim=0).tolist() == [4, 5, 6, 7]


def test_a_length_that_does_not_divide_is_refused_with_the_multiple():
    x = torch.randn(1, 10, 2)
    with pytest.raises(ValueError, match="10 positions cannot be split evenly into 3 ranks"):
        shard(x, 0, 3)
    with pytest.raises(ValueError, match=r"into 8 chunks.*multiple of 8"):
        shard(torch.randn(1, 12, 2), 0, 4, layout="zigzag")


def test_bad_arguments_are_named():
    x = torch.randn(1, 8, 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="rank must be in"):
        shard(x, 2, 2)
    with pytest.raises(ValueError, match="dim must be"):
        shard(x, 0, 2, dim=3)
    with pytest.raises(TypeError, match="x must be a tensor"):
        shard([1, 2], 0, 2)
    with pytest.raises(ValueError, match="same shape"):
        unshard([x, x[:, :4]])
