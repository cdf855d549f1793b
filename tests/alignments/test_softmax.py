"""Softmax alignment against a loop from Brauwers eq. 25."""

import math

import pytest
import torch
from alignments.rows import per_row
from helpers import assert_same_forward_backward, rand

from attnkit import alignments as al


def softmax_row(e, allowed, _m, tau=1.0):
    out = []
    denom = sum(torch.exp(e[j] / tau) for j in range(len(e)) if allowed[j])
    for j in range(len(e)):
        out.append(torch.exp(e[j] / tau) / denom if allowed[j] else e[j] * 0)
    return torch.stack(out)


@pytest.mark.parametrize("tau", [1.0, 0.5, 3.0])
def test_softmax_eq25(tau):
    e = rand(2, 3, 5)
    mask = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True
    align = al.Softmax(tau)
    assert_same_forward_backward(
        lambda: align(e, mask).weights,
        lambda: per_row(lambda r, a, m: softmax_row(r, a, m, tau), e, mask),
        [e],
    )


def test_learned_temperature_gets_gradient():
    align = al.Softmax(2.0, learnable=True)
    w = align(rand(2, 3, 5)).weights
    (w * torch.arange(5.0, dtype=w.dtype)).sum().backward()
    assert align.log_temperature.grad is not None and align.log_temperature.grad != 0
    torch.testing.assert_close(align.temperature.detach(), torch.tensor(2.0))


def test_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        al.Softmax(0.0)


def test_temperature_is_exact_in_float64_and_follows_double():
    e = torch.randn(2, 3, 5, dtype=torch.float64)
    ref = torch.exp(e / 0.3) / torch.exp(e / 0.3).sum(-1, keepdim=True)  # eq. 25 with τ = 0.3
    torch.testing.assert_close(al.Softmax(0.3)(e).weights, ref, atol=1e-15, rtol=1e-14)
    learned = al.Softmax(0.3, learnable=True).double()
    assert learned.log_temperature.dtype == torch.float64
    learned.log_temperature.data.fill_(math.log(0.3))
    torch.testing.assert_close(learned(e).weights, ref, atol=1e-14, rtol=1e-13)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_temperature_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="temperature"):
        al.Softmax(bad)
