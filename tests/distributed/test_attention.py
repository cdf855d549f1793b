"""RingAttention, the per-head part: what it refuses before any communication. Its results in
MultiHeadAttention against the layer on the whole sequence are checked by the spawned workers
of test_ring.py (ring_workers._multihead)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.distributed import RingAttention


def test_the_part_fits_the_attention_slot():
    mha = ak.MultiHeadAttention(8, 2, attention=RingAttention(causal=True, layout="zigzag"))
    assert isinstance(mha.attention, RingAttention)


def test_unsupported_parts_and_options_are_refused_at_construction():
    with pytest.raises(ValueError, match="cannot evaluate this part"):
        RingAttention(align="hard")
    with pytest.raises(ValueError, match="layout must be one of"):
        RingAttention(layout="striped")
    with pytest.raises(TypeError, match="causal must be a bool"):
        RingAttention(causal=1)


def test_bias_weights_and_row_masks_are_refused():
    part = RingAttention()
    x = torch.randn(2, 2, 4, 3)
    with pytest.raises(ValueError, match="RingAttention does not declare accepts_bias = True"):
        part(x, x, x, bias=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="does not return weights"):
        part(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="causal=True"):
        part(x, x, x, mask=torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="padded keys only"):
        part(x, x, x, mask=torch.ones(2, 2, 1, 4, dtype=torch.bool))  # differs per head


def test_listening_to_hooks_asks_no_weights_of_it():
    """The part never holds whole rows of weights (returns_weights is False): inside a listen
    block it is called as outside (here: refused for want of a process group, not for the
    weights) and reports nothing."""
    x = torch.randn(2, 2, 4, 3)
    with ak.hooks.listen() as reports, pytest.raises(ValueError, match="init_process_group"):
        RingAttention()(x, x, x)
    assert reports == []
    assert RingAttention.returns_weights is False and RingAttention.sharded is True
