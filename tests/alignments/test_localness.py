"""Localness with predicted centre and window (Yang et al. 2018) against a loop from eqs. 6-9."""

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit import alignments as al


def row(e, allowed, q, W_p, U_p, U_d):
    """Yang et al.: P = I·sigmoid(U_pᵀ tanh(W_p q)), D = I·sigmoid(U_dᵀ tanh(W_p q)),
    G_j = −(j − P)² / (2 (D/2)²), a = softmax(e + G) over the allowed keys."""
    if not any(allowed):
        return e * 0
    size = sum(allowed)  # I
    hidden = torch.tanh(W_p @ q)
    centre = size * torch.sigmoid(U_p @ hidden)
    sigma = size * torch.sigmoid(U_d @ hidden) / 2
    g = [-((j - centre) ** 2) / (2 * sigma**2) for j in range(len(e))]
    z = sum(torch.exp(e[j] + g[j]) for j in range(len(e)) if allowed[j])
    return torch.stack(
        [torch.exp(e[j] + g[j]) / z if allowed[j] else e[j] * 0 for j in range(len(e))]
    )


def test_equals_the_loop():
    torch.manual_seed(0)
    align = al.PredictedWindow(4, 3, dtype=torch.float64)
    e, q = rand(2, 3, 7), rand(2, 3, 4, seed=1)
    mask = torch.ones(2, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = False
    W_p, U = align.W_p.weight, align.U.weight

    def loop():
        return torch.stack(
            [
                torch.stack(
                    [row(e[i, m], mask[i, 0].tolist(), q[i, m], W_p, U[0], U[1]) for m in range(3)]
                )
                for i in range(2)
            ]
        )

    assert_same_forward_backward(
        lambda: align(e, mask, query=q).weights,
        loop,
        [e, q, W_p, U],
        atol=1e-12,
        rtol=1e-10,
    )


def test_the_bias_peaks_at_the_predicted_centre():
    torch.manual_seed(1)
    align = al.PredictedWindow(2, dtype=torch.float64)
    e = torch.zeros(1, 2, 9, dtype=torch.float64)  # no content preference: the bias decides
    q = rand(1, 2, 2, seed=2, grad=False)
    with torch.no_grad():
        centre, width = align.centre_and_width(e, None, q)
        w = align(e, query=q).weights[0]
    for m in range(2):
        assert abs(int(w[m].argmax()) - float(centre[0, m, 0])) <= 0.5
        assert 0 < float(width[0, m, 0]) < 9


def test_per_head_predictors_in_multihead_attention():
    torch.manual_seed(2)
    align = al.PredictedWindow(4, num_heads=2, dtype=torch.float64)
    mha = ak.MultiHeadAttention(8, 2, align=align, dtype=torch.float64)
    assert align.W_p.weight.shape == (2, 4, 4)
    out = mha(rand(2, 5, 8, seed=3, grad=False), need_weights=True)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="query=None"):
        al.PredictedWindow(4)(torch.randn(1, 2, 3))
    with pytest.raises(TypeError, match="predicted_window"):
        al.PredictedWindow(4)(torch.randn(1, 2, 3), query=torch.randn(1, 2, 4).double())
