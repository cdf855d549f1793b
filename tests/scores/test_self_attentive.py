"""Learned-query score (Brauwers eq. 34) against a loop."""

import math

import torch
from helpers import assert_same_forward_backward, rand

from attnkit import scores as sc


def test_learned_query_eq34():
    torch.manual_seed(0)
    s = sc.LearnedQuery(4).double()
    k = rand(2, 5, 4, seed=2)
    qv = s.query[0]

    def loop():
        return torch.stack([torch.stack([qv @ k[i, l] for l in range(5)]) for i in range(2)])[
            :, None
        ]

    assert_same_forward_backward(lambda: s(None, k), loop, [k, s.query])


def test_learned_query_scaled_and_dot_form():
    torch.manual_seed(0)
    s = sc.LearnedQuery(4, scaled=True).double()
    k = rand(2, 5, 4, seed=2, grad=False)
    torch.testing.assert_close(s(None, k), (s.query @ k.transpose(-1, -2)) / math.sqrt(4))
    qp, kp, scale = s.dot_form(torch.zeros(2, 3, 9, dtype=torch.float64), k)
    assert qp.shape == (2, 3, 4)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), s(torch.zeros(2, 3, 9), k))
