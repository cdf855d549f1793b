"""Query-dependent temperature (Lin et al. 2018) against a loop from τ = λ^tanh(wᵀq + b)."""

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit import alignments as al


def row(e, allowed, q, w, b, base):
    """a_l = exp(e_l/τ) / Σ_j exp(e_j/τ) over the allowed keys, τ = base^tanh(w·q + b)."""
    tau = base ** torch.tanh(sum(w[i] * q[i] for i in range(len(q))) + b)
    if not any(allowed):
        return e * 0
    z = sum(torch.exp(e[j] / tau) for j in range(len(e)) if allowed[j])
    return torch.stack(
        [torch.exp(e[j] / tau) / z if allowed[j] else e[j] * 0 for j in range(len(e))]
    )


def test_equals_the_loop():
    torch.manual_seed(0)
    align = al.QueryTemperature(4, base=3.0, dtype=torch.float64)
    e, q = rand(2, 3, 5), rand(2, 3, 4, seed=1)
    mask = torch.ones(2, 1, 5, dtype=torch.bool)
    mask[1, :, 3:] = False
    w, b = align.predictor.weight[0], align.predictor.bias[0]

    def loop():
        return torch.stack(
            [
                torch.stack(
                    [row(e[i, m], mask[i, 0].tolist(), q[i, m], w, b, 3.0) for m in range(3)]
                )
                for i in range(2)
            ]
        )

    assert_same_forward_backward(
        lambda: align(e, mask, query=q).weights,
        loop,
        [e, q, align.predictor.weight, align.predictor.bias],
        atol=1e-12,
        rtol=1e-10,
    )


def test_the_temperature_stays_within_its_bounds_and_sharpens():
    torch.manual_seed(1)
    align = al.QueryTemperature(2, base=4.0, dtype=torch.float64)
    with torch.no_grad():
        align.predictor.weight.copy_(torch.tensor([[1.0, 0.0]]))
        align.predictor.bias.zero_()
    q = torch.tensor([[[-50.0, 0.0], [0.0, 0.0], [50.0, 0.0]]], dtype=torch.float64)
    tau = align.temperature(q)[0, :, 0]
    torch.testing.assert_close(tau, torch.tensor([0.25, 1.0, 4.0], dtype=torch.float64))
    e = torch.tensor([[[0.0, 1.0, 2.0]] * 3], dtype=torch.float64)
    w = align(e, query=q).weights[0]
    assert w[0].max() > w[1].max() > w[2].max()  # τ = 1/4 sharpest, τ = 4 smoothest


def test_per_head_predictors_in_multihead_attention():
    torch.manual_seed(2)
    align = al.QueryTemperature(4, num_heads=2, dtype=torch.float64)
    mha = ak.MultiHeadAttention(8, 2, align=align, dtype=torch.float64)
    x = rand(2, 5, 8, seed=3, grad=False)
    out = mha(x, need_weights=True)
    assert out.weights.shape == (2, 2, 5, 5)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))


def test_bad_arguments():
    with pytest.raises(ValueError, match="base"):
        al.QueryTemperature(4, base=1.0)
    with pytest.raises(ValueError, match="query=None"):
        al.QueryTemperature(4)(torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match="d_q = 4"):
        al.QueryTemperature(4)(torch.randn(1, 2, 3), query=torch.randn(1, 2, 5))
