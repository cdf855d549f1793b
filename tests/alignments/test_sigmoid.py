"""Sigmoid alignment (Galassi IV-C)."""

import torch
from helpers import rand

from attnkit import alignments as al


def test_sigmoid_is_independent_per_key():
    e = rand(2, 3, 5, grad=False)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[0, 0, 2] = False
    w = al.Sigmoid()(e, mask).weights
    expected = 1 / (1 + torch.exp(-e))
    expected[0, 0, 2] = 0
    torch.testing.assert_close(w, expected)
    assert not al.Sigmoid().normalized
