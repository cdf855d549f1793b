"""Sinusoidal positions against Vaswani et al. 3.5 written out per entry."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import Sinusoidal


def test_matches_the_paper_entry_by_entry():
    d, n, offset = 6, 5, 3
    x = torch.randn(2, n, d, dtype=torch.float64)
    out = Sinusoidal(d)(x, offset=offset)
    ref = x.clone()
    for b in range(2):
        for t in range(n):
            pos = offset + t
            for i in range(d // 2):
                ref[b, t, 2 * i] += math.sin(pos / 10000 ** (2 * i / d))
                ref[b, t, 2 * i + 1] += math.cos(pos / 10000 ** (2 * i / d))
    torch.testing.assert_close(out, ref)


def test_offset_continues_the_sequence():
    pe = Sinusoidal(8)
    zeros = torch.zeros(1, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(pe(zeros[:, :4], offset=6), pe(zeros)[:, 6:])


def test_gradcheck():
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: Sinusoidal(4)(t), (x,))


def test_errors_and_registry():
    with pytest.raises(ValueError, match="even"):
        Sinusoidal(5)
    with pytest.raises(ValueError, match="embed_dim = 4"):
        Sinusoidal(4)(torch.randn(2, 3, 6))
    assert isinstance(ak.positions.build("sinusoidal", embed_dim=4), Sinusoidal)
    with pytest.raises(TypeError, match="absolute embedding"):
        ak.MultiHeadAttention(8, 2, position="sinusoidal")
    with pytest.raises(TypeError, match="absolute embedding"):
        ak.MultiHeadAttention(8, 2, position=Sinusoidal(8))
