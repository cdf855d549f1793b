"""Multiplicative scores against loops written from Brauwers Table II."""

import math

import pytest
import torch
from helpers import assert_same_forward_backward, rand

from attnkit import scores as sc


def _loop(q, k, pair):
    b, m, n = q.shape[0], q.shape[1], k.shape[1]
    return torch.stack(
        [
            torch.stack([torch.stack([pair(q[i, a], k[i, c]) for c in range(n)]) for a in range(m)])
            for i in range(b)
        ]
    )


def test_dot():
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert_same_forward_backward(lambda: sc.Dot()(q, k), lambda: _loop(q, k, torch.dot), [q, k])


def test_scaled_dot():
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert_same_forward_backward(
        lambda: sc.ScaledDot()(q, k),
        lambda: _loop(q, k, lambda x, y: torch.dot(x, y) / math.sqrt(4)),
        [q, k],
    )


def test_general():
    torch.manual_seed(0)
    s = sc.General(5, 4).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W = s.W.weight  # (d_k, d_q)
    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, lambda x, y: y @ (W @ x)), [q, k, W]
    )


def test_biased_general():
    torch.manual_seed(0)
    s = sc.BiasedGeneral(5, 4).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, bias = s.W.weight, s.W.bias
    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, lambda x, y: y @ (W @ x + bias)), [q, k, W, bias]
    )


@pytest.mark.parametrize("act", ["tanh", "relu", "selu"])
def test_activated_general(act):
    torch.manual_seed(0)
    s = sc.ActivatedGeneral(5, 4, activation=act).double()
    with torch.no_grad():
        s.b.fill_(0.3)
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, b = s.W.weight, s.b
    f = {"tanh": torch.tanh, "relu": torch.relu, "selu": torch.selu}[act]
    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, lambda x, y: f(y @ W @ x + b)), [q, k, W, b]
    )


@pytest.mark.parametrize("cls", [sc.General, sc.BiasedGeneral, sc.ActivatedGeneral])
def test_per_head_parameters_equal_one_score_per_head(cls):
    torch.manual_seed(0)
    heads = cls(5, 4, heads=3).double()
    q, k = rand(2, 3, 4, 5, seed=1, grad=False), rand(2, 3, 6, 4, seed=2, grad=False)
    e = heads(q, k)
    for h in range(3):
        one = cls(5, 4).double()
        with torch.no_grad():
            one.W.weight.copy_(heads.W.weight[h])
            if one.W.bias is not None:
                one.W.bias.copy_(heads.W.bias[h])
            if hasattr(one, "b"):
                one.b.copy_(heads.b[h, 0, 0])
        torch.testing.assert_close(e[:, h], one(q[:, h], k[:, h]))


@pytest.mark.parametrize("cls", [sc.Dot, sc.ScaledDot, sc.General, sc.BiasedGeneral])
def test_dot_form_reproduces_scores(cls):
    torch.manual_seed(0)
    s = cls() if cls in (sc.Dot, sc.ScaledDot) else cls(4, 4)
    s = s.double()
    q, k = rand(2, 3, 4, seed=1, grad=False), rand(2, 6, 4, seed=2, grad=False)
    qp, kp, scale = s.dot_form(q, k)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), s(q, k))


def test_dot_needs_equal_sizes():
    with pytest.raises(ValueError, match=r"d_q == d_k.*\(2, 3, 5\).*\(2, 6, 4\)"):
        sc.Dot()(torch.randn(2, 3, 5), torch.randn(2, 6, 4))
