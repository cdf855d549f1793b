"""One rank's tiles: pieces of the layout's segments, and which tiles the causal mask leaves
empty (skipped), which makes the zigzag layout balanced."""

from __future__ import annotations

import pytest
import torch

from attnkit import alignments, scores
from attnkit.distributed.layout import Segment, segments
from attnkit.distributed.tiles import Plan, pieces
from attnkit.distributed.transport import Ring


def _ring(rank: int, size: int) -> Ring:
    ring = Ring.__new__(Ring)  # the plan reads only the ring's rank and size
    ring.rank, ring.size = rank, size
    return ring


def _plan(rank: int, size: int, local: int, layout: str, block: int) -> Plan:
    return Plan(
        score=scores.ScaledDot(),
        align=alignments.Softmax(),
        ring=_ring(rank, size),
        layout=layout,
        causal=True,
        m_local=local,
        n_local=local,
        lead=torch.Size((1,)),
        work=torch.float64,
        block_q=block,
        block_k=block,
        stat_k=block,
        padded=False,
        guard=False,
        block_mask=None,
        score_mod=None,
        device=torch.device("cpu"),
    )


def test_pieces_cut_each_segment_in_local_order():
    cut = pieces((Segment(0, 0, 5), Segment(30, 5, 3)), 2)
    assert [(p.start, p.local, p.length) for p in cut] == [
        (0, 0, 2),
        (2, 2, 2),
        (4, 4, 1),
        (30, 5, 2),
        (32, 7, 1),
    ]


def _pairs(plan: Plan, size: int, local: int) -> int:
    """Allowed (query, key) pairs in the tiles the rank evaluates over a whole turn."""
    total = 0
    for owner in range(size):
        for rows in plan.row_pieces:
            for keys in plan.key_pieces(owner, plan.block_k):
                if plan.visible(rows, keys, None):
                    total += rows.length * keys.length
    return total


@pytest.mark.parametrize("size", [2, 3, 4])
def test_zigzag_balances_the_causal_work_and_contiguous_does_not(size):
    local = 8
    zigzag = [_pairs(_plan(r, size, local, "zigzag", 4), size, local) for r in range(size)]
    contiguous = [_pairs(_plan(r, size, local, "contiguous", 4), size, local) for r in range(size)]
    assert len(set(zigzag)) == 1
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    # Skipping empty tiles keeps every allowed pair: count them straight from the positions.
    for r in range(size):
        q_pos = [s.start + i for s in segments(r, size, local, "zigzag") for i in range(s.length)]
        allowed = sum(q + 1 for q in q_pos)
        assert allowed <= zigzag[r] <= local * local * size


def test_visible_follows_global_positions():
    plan = _plan(0, 2, 8, "zigzag", 4)  # rank 0 holds positions 0-3 (front) and 12-15 (back)
    front, back = plan.row_pieces
    owner_1 = plan.key_pieces(1, 4)  # rank 1 holds 4-7 and 8-11
    assert [plan.visible(front, keys, None) for keys in owner_1] == [False, False]
    assert [plan.visible(back, keys, None) for keys in owner_1] == [True, True]
    mask = plan.mask(back, plan.key_pieces(0, 4)[1], None)  # rows 12-15, keys 12-15
    assert torch.equal(mask, torch.ones(4, 4, dtype=torch.bool).tril())
