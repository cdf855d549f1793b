"""Location- and convolution-based scores against loops from their definitions (Galassi IV-B)."""

import pytest
import torch
from helpers import assert_same_forward_backward, rand

from attnkit import scores as sc


def test_location_depends_only_on_query_and_position():
    torch.manual_seed(0)
    s = sc.Location(5, max_len=8).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, b = s.W_a.weight, s.W_a.bias

    def loop():
        return torch.stack(
            [
                torch.stack(
                    [torch.stack([W[l] @ q[i, m] + b[l] for l in range(6)]) for m in range(3)]
                )
                for i in range(2)
            ]
        )

    assert_same_forward_backward(lambda: s(q, k), loop, [q, W, b])
    torch.testing.assert_close(s(q, k), s(q, torch.randn_like(k)))  # content is ignored


def test_location_rejects_too_long_sequences():
    with pytest.raises(ValueError, match=r"N = 9 keys .* max_len = 8"):
        sc.Location(5, max_len=8)(torch.randn(1, 2, 5), torch.randn(1, 9, 3))


@pytest.mark.parametrize("width", [1, 2, 3])
def test_convolutional(width):
    torch.manual_seed(0)
    s = sc.Convolutional(4, width=width).double()
    with torch.no_grad():
        s.b.fill_(0.2)
    n = 6
    k = rand(2, n, 4, seed=2)
    f, b = s.filter[0], s.b[0]  # (d_k, width), scalar

    def key(i, j):  # zero padding outside the sequence
        return k[i, j] if 0 <= j < n else torch.zeros(4, dtype=k.dtype)

    def window(i, j):  # energy of the window starting at key j
        return torch.tanh(sum(f[:, t] @ key(i, j + t) for t in range(width)) + b)

    def loop():
        per_key = [
            [sum(window(i, j) for j in range(l - width + 1, l + 1)) / width for l in range(n)]
            for i in range(2)
        ]
        return torch.stack([torch.stack(row) for row in per_key]).unsqueeze(1)

    assert_same_forward_backward(lambda: s(None, k), loop, [k, s.filter, s.b])


def test_convolutional_heads_equal_one_score_per_head():
    torch.manual_seed(0)
    heads = sc.Convolutional(4, width=3, heads=2).double()
    k = rand(2, 2, 6, 4, seed=2, grad=False)
    e = heads(None, k)
    assert e.shape == (2, 2, 1, 6)
    for h in range(2):
        one = sc.Convolutional(4, width=3).double()
        with torch.no_grad():
            one.filter.copy_(heads.filter[h : h + 1])
            one.b.copy_(heads.b[h : h + 1])
        torch.testing.assert_close(e[:, h], one(None, k[:, h]))
