"""Similarity scores against loops written from their definitions."""

import torch
from helpers import assert_same_forward_backward, rand
from scores.test_multiplicative import _loop

from attnkit import scores as sc


def test_cosine():
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert_same_forward_backward(
        lambda: sc.Cosine()(q, k),
        lambda: _loop(q, k, lambda x, y: torch.dot(x, y) / (x.norm() * y.norm())),
        [q, k],
    )


def test_negative_euclidean():
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert_same_forward_backward(
        lambda: sc.Euclidean()(q, k),
        lambda: _loop(q, k, lambda x, y: -torch.sqrt(((x - y) ** 2).sum())),
        [q, k],
    )


def test_euclidean_broadcasts_batch_dims():
    q, k = rand(1, 3, 4, seed=1, grad=False), rand(2, 5, 4, seed=2, grad=False)
    e = sc.Euclidean()(q, k)
    assert e.shape == (2, 3, 5)
    torch.testing.assert_close(e[1], sc.Euclidean()(q[0], k[1]))


def test_cosine_is_in_dot_form():
    q, k = rand(2, 3, 4, seed=1, grad=False), rand(2, 5, 4, seed=2, grad=False)
    qp, kp, scale = sc.Cosine().dot_form(q, k)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), sc.Cosine()(q, k))
