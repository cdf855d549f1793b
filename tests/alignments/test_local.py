"""Local alignment against a loop from Brauwers eqs. 27-29."""

import math

import pytest
import torch
from alignments.rows import per_row
from helpers import assert_same_forward_backward, rand

from attnkit import alignments as al


def local_row(e, allowed, p, window, gaussian):
    p = torch.as_tensor(p, dtype=e.dtype)
    centre = round(float(p.detach()))
    inside = [allowed[j] and abs(j - centre) <= window for j in range(len(e))]
    denom = sum(torch.exp(e[j]) for j in range(len(e)) if inside[j])
    out = []
    for j in range(len(e)):
        a = torch.exp(e[j]) / denom if inside[j] else e[j] * 0  # eq. 27
        if gaussian:
            sigma = window / 2
            a = a * torch.exp(-((j - p) ** 2) / (2 * sigma**2))  # eq. 29
        out.append(a)
    return torch.stack(out)


@pytest.mark.parametrize("gaussian", [False, True])
def test_monotonic(gaussian):
    e = rand(2, 4, 7)
    mask = torch.ones(2, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = False
    align = al.Local(2, gaussian=gaussian)
    assert_same_forward_backward(
        lambda: align(e, mask).weights,
        lambda: per_row(lambda r, a, m: local_row(r, a, m, 2, gaussian), e, mask),
        [e],
    )


def test_predictive_eq28():
    torch.manual_seed(0)
    align = al.Local(2, "predictive", d_q=5, d_p=4).double()
    e, q = rand(2, 3, 8, seed=1), rand(2, 3, 5, seed=2)
    mask = torch.ones(2, 1, 8, dtype=torch.bool)
    mask[1, :, 6:] = False
    Wp, wp = align.W_p.weight, align.w_p.weight  # wp: (1, d_p)

    def loop():
        rows = []
        for i in range(2):
            s = int(mask[i, 0].sum())
            ps = [(s - 1) * torch.sigmoid(wp[0] @ torch.tanh(Wp @ q[i, m])) for m in range(3)]
            rows.append(
                torch.stack(
                    [local_row(e[i, m], mask[i, 0].tolist(), ps[m], 2, True) for m in range(3)]
                )
            )
        return torch.stack(rows)

    assert_same_forward_backward(lambda: align(e, mask, query=q).weights, loop, [e, q, Wp, wp])


def test_window_larger_than_sequence():
    with pytest.raises(ValueError, match=r"2·3\+1 = 7 keys .* N = 5"):
        al.Local(3)(torch.randn(1, 2, 5))


def test_predictive_needs_query_size_and_query():
    with pytest.raises(TypeError, match="d_q"):
        al.Local(1, "predictive")
    with pytest.raises(ValueError, match="query"):
        al.Local(1, "predictive", d_q=3)(torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match="position"):
        al.Local(1, "sideways")


def test_gaussian_sigma():
    # Weight at distance D from p is the window softmax times exp(-2) (σ = D/2).
    align = al.Local(2, gaussian=True)
    e = torch.zeros(1, 3, 7, dtype=torch.float64)
    w = align(e).weights
    torch.testing.assert_close(w[0, 2, 4], torch.tensor(math.exp(-2) / 5, dtype=torch.float64))
