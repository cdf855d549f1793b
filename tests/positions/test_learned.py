"""Learned absolute positions: x + P[offset + l], refused beyond the table."""

import pytest
import torch

import attnkit as ak
from attnkit.positions import Learned


def test_adds_the_row_of_each_position():
    pe = Learned(4, max_len=10, dtype=torch.float64)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    out = pe(x, offset=5)
    for t in range(3):
        torch.testing.assert_close(out[:, t], x[:, t] + pe.weight[5 + t])


def test_gradcheck_inputs_and_table():
    pe = Learned(4, max_len=6, dtype=torch.float64)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = pe.weight.detach().clone().requires_grad_()

    def f(t, w):
        return torch.func.functional_call(pe, {"weight": w}, (t,), {"offset": 1})

    assert torch.autograd.gradcheck(f, (x, w))
    pe(x).sum().backward()
    assert pe.weight.grad[:3].abs().sum() > 0 and pe.weight.grad[3:].abs().sum() == 0


def test_errors_and_registry():
    pe = Learned(4, max_len=6)
    with pytest.raises(ValueError, match="max_len = 6"):
        pe(torch.randn(1, 4, 4), offset=3)
    with pytest.raises(ValueError, match="embed_dim = 4"):
        pe(torch.randn(1, 4, 5))
    assert isinstance(ak.positions.build("learned", embed_dim=4), Learned)
    with pytest.raises(TypeError, match="absolute embedding"):
        ak.MultiHeadAttention(8, 2, position="learned")
