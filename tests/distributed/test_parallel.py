"""context_parallel: the ring twin of a model shares its parameters and refuses parts the ring
cannot evaluate. Its results against the model on the whole sequence are checked by the spawned
workers of test_positions.py."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.distributed import RingAttention, context_parallel
from attnkit.positions import ALiBi


def test_parts_the_ring_cannot_evaluate_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dropout 0\.1 is not offered"):
        context_parallel(ak.MultiHeadAttention(8, 2, dropout=0.1))
    with pytest.raises(ValueError, match=r"no attnkit\.MultiHeadAttention layer"):
        context_parallel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cannot evaluate this part"):
        context_parallel(ak.MultiHeadAttention(8, 2, align="hard"))


def test_the_twin_shares_the_parameters():
    mha = ak.MultiHeadAttention(8, 2, position="alibi")
    twin = context_parallel(mha)
    assert [id(p) for p in twin.parameters()] == [id(p) for p in mha.parameters()]
    assert type(mha.attention) is ak.Attention  # the model itself is unchanged
    assert isinstance(mha.position, ALiBi)


def test_the_twin_moves_the_position_scheme_into_the_ring_part():
    mha = ak.MultiHeadAttention(8, 2, position="t5")
    twin = context_parallel(mha, layout="zigzag", causal=True)
    assert isinstance(twin.attention, RingAttention)
    assert twin.attention.position.scheme.weight is mha.position.weight  # T5's table, shared
    assert type(twin.position).__name__ == "NoPosition"
    assert (twin.attention.layout, twin.attention.causal) == ("zigzag", True)
