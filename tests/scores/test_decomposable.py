"""Decomposable scores (Galassi eq. 13; Parikh et al.) against loops written from the equation,
and the direction task: separate networks learn a role-dependent relation, a shared one cannot."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand
from successor_task import V, direction_accuracy

import attnkit as ak
from attnkit.scores import Decomposable, SharedDecomposable


def _loop(q, k, pair):
    """E[b, m, n] = pair(q[b, m], k[b, n]), one scalar at a time."""
    return torch.stack(
        [
            torch.stack([torch.stack([pair(x, y) for y in k[b]]) for x in q[b]])
            for b in range(q.shape[0])
        ]
    )


def _network(x, W, b, act):
    """act(W x + b) for one vector x."""
    return act(W @ x + b)


@pytest.mark.parametrize("act", ["relu", "tanh"])
def test_separate_networks_eq13(act):
    torch.manual_seed(0)
    s = Decomposable(5, 4, 6, activation=act).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 4, 4, seed=2)
    f = {"relu": torch.relu, "tanh": torch.tanh}[act]
    W1, b1, W2, b2 = s.W1.weight, s.W1.bias, s.W2.weight, s.W2.bias

    def eq13(x, y):
        return (_network(x, W1, b1, f) * _network(y, W2, b2, f)).sum()

    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, eq13), [q, k, *s.parameters()]
    )


def test_shared_network_is_eq13_with_one_network_and_symmetric():
    torch.manual_seed(0)
    s = SharedDecomposable(4, 6).double()
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    W, b = s.W1.weight, s.W1.bias
    assert_same_forward_backward(
        lambda: s(q, k),
        lambda: _loop(
            q, k, lambda x, y: (_network(x, W, b, torch.relu) * _network(y, W, b, torch.relu)).sum()
        ),
        [q, k, W, b],
    )
    torch.testing.assert_close(s(k, q), s(q, k).transpose(-1, -2))
    assert [n for n, _ in s.named_parameters()] == ["W1.weight", "W1.bias"]


def test_separate_networks_depend_on_the_roles():
    torch.manual_seed(0)
    s = Decomposable(4, 4, 6, activation="tanh").double()
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert (s(k, q) - s(q, k).transpose(-1, -2)).abs().max() > 1e-2


def test_direction_task_needs_separate_networks():
    assert direction_accuracy(Decomposable(V, V, 16)) == 1.0
    assert direction_accuracy(SharedDecomposable(V, 16)) <= 0.5  # symmetric: one of each pair


def test_dot_form_heads_and_registry():
    torch.manual_seed(0)
    s = Decomposable(4, 4, 3, num_heads=2).double()
    q, k = rand(1, 2, 3, 4, seed=1), rand(1, 2, 5, 4, seed=2)
    qp, kp, scale = s.dot_form(q, k)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), s(q, k))
    for h in range(2):
        alone = Decomposable(4, 4, 3).double()
        for name in ("W1", "W2"):
            getattr(alone, name).weight.data = getattr(s, name).weight.data[h]
            getattr(alone, name).bias.data = getattr(s, name).bias.data[h]
        torch.testing.assert_close(s(q, k)[:, h], alone(q[:, h], k[:, h]))
    assert isinstance(ak.scores.build("decomposable", d_q=4, d_k=5, d_w=3), Decomposable)
    assert isinstance(ak.scores.build("decomposable_shared", d_k=4, d_w=3), SharedDecomposable)
    for name in ("decomposable", "decomposable_shared"):
        mha = ak.MultiHeadAttention(8, 2, score=name)
        assert mha(torch.randn(2, 5, 8)).context.shape == (2, 5, 8)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"q has 3 features .* d_q"):
        Decomposable(4, 4, 3)(torch.randn(1, 2, 3), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match=r"k has 3 features .* d_k"):
        SharedDecomposable(4, 3)(torch.randn(1, 2, 4), torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match="d_w"):
        Decomposable(4, 4, 0)
