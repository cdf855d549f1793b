"""The additive family against loops written from Brauwers Table II / eqs. 31, 33 and
Galassi Table IV (concat, deep)."""

import pytest
import torch
from helpers import assert_same_forward_backward, rand

from attnkit import scores as sc


def _loop(q, k, pair):
    """pair(q_m or None, k_n) -> score (scalar or vector); stacked to (B, M, N[, d])."""
    b, n = k.shape[0], k.shape[1]
    rows = [None] if q is None else [q[:, a] for a in range(q.shape[1])]
    return torch.stack(
        [
            torch.stack(
                [
                    torch.stack([pair(None if r is None else r[i], k[i, c]) for c in range(n)])
                    for r in rows
                ]
            )
            for i in range(b)
        ]
    )


def _params(s):
    return [p for p in s.parameters()]


@pytest.mark.parametrize("act", ["tanh", "relu"])
def test_additive(act):
    torch.manual_seed(0)
    s = sc.Additive(5, 4, 7, activation=act).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    f = {"tanh": torch.tanh, "relu": torch.relu}[act]
    W1, W2, b, w = s.W1.weight, s.W2.weight, s.W2.bias, s.w.weight[0]
    assert_same_forward_backward(
        lambda: s(q, k),
        lambda: _loop(q, k, lambda x, y: w @ f(W1 @ x + W2 @ y + b)),  # eq. 6
        [q, k, *_params(s)],
    )


def test_additive_self_attentive_eq33():
    torch.manual_seed(0)
    s = sc.Additive(None, 4, 7).double()
    k = rand(2, 6, 4, seed=2)
    W, b, w = s.W2.weight, s.W2.bias, s.w.weight[0]
    assert_same_forward_backward(
        lambda: s(None, k),
        lambda: _loop(None, k, lambda _, y: w @ torch.tanh(W @ y + b)),  # eq. 33
        [k, *_params(s)],
    )


def test_additive_multi_dimensional_eq31():
    torch.manual_seed(0)
    s = sc.Additive(5, 4, 7, d_out=3).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W1, W2, b, Wd = s.W1.weight, s.W2.weight, s.W2.bias, s.w.weight.T  # Wd: (d_w, d_v)
    assert_same_forward_backward(
        lambda: s(q, k),
        lambda: _loop(q, k, lambda x, y: Wd.T @ torch.tanh(W1 @ x + W2 @ y + b)),  # eq. 31
        [q, k, *_params(s)],
    )


def test_concat_acts_on_the_concatenation():
    torch.manual_seed(0)
    s = sc.Concat(5, 4, 7).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, b, w = s.W.weight, s.W.bias, s.w.weight[0]
    assert_same_forward_backward(
        lambda: s(q, k),
        lambda: _loop(q, k, lambda x, y: w @ torch.tanh(W @ torch.cat([x, y]) + b)),
        [q, k, *_params(s)],
    )


def test_concat_query_free():
    torch.manual_seed(0)
    s = sc.Concat(None, 4, 7).double()
    k = rand(2, 6, 4, seed=2)
    W, b, w = s.W.weight, s.W.bias, s.w.weight[0]
    assert_same_forward_backward(
        lambda: s(None, k),
        lambda: _loop(None, k, lambda _, y: w @ torch.tanh(W @ y + b)),
        [k, *_params(s)],
    )


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_deep(depth):
    torch.manual_seed(0)
    s = sc.Deep(5, 4, 6, depth=depth).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)

    def pair(x, y):
        h = torch.tanh(s.W1.weight @ x + s.W2.weight @ y + s.W2.bias)
        for layer in s.hidden:
            h = torch.tanh(layer.weight @ h + layer.bias)
        return s.w.weight[0] @ h

    assert_same_forward_backward(lambda: s(q, k), lambda: _loop(q, k, pair), [q, k, *_params(s)])


@pytest.mark.parametrize("cls", [sc.Additive, sc.Concat, sc.Deep])
def test_per_head_parameters_equal_one_score_per_head(cls):
    torch.manual_seed(0)
    heads = cls(5, 4, 6, num_heads=3).double()
    q, k = rand(2, 3, 4, 5, seed=1, grad=False), rand(2, 3, 6, 4, seed=2, grad=False)
    e = heads(q, k)
    for h in range(3):
        one = cls(5, 4, 6).double()
        with torch.no_grad():
            for p1, ph in zip(one.parameters(), heads.parameters(), strict=True):
                p1.copy_(ph[h])
        torch.testing.assert_close(e[:, h], one(q[:, h], k[:, h]))


def test_wrong_feature_sizes_are_named():
    s = sc.Additive(5, 4, 7)
    with pytest.raises(ValueError, match=r"q has 6 features .* d_q = 5"):
        s(torch.randn(2, 3, 6), torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match=r"k has 3 features .* d_k = 4"):
        s(torch.randn(2, 3, 5), torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="depth"):
        sc.Deep(5, 4, 7, depth=0)
