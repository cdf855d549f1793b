"""Random feature attention (Peng et al. 2021): random Fourier features estimate the Gaussian
kernel without bias, the attention approaches softmax over unit vectors at temperature σ², and
the gated causal form is RFA eq. 7's recurrence."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import RandomFeatureAttention

D = torch.float64


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def _qkv(seed=0, lead=(2,), n=24, d=6, dv=3):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, n, s, generator=g, dtype=D) for s in (d, d, dv))


def test_the_gaussian_kernel_estimate_is_unbiased():
    """Mean of φ(x)·φ(y) over 400 independent draws (256 frequencies each) vs
    exp(−‖x − y‖²/2σ²) for unit x, y: within 4 standard errors of the mean (fails with
    probability < 1e-4 when unbiased), with SE small enough to catch a bias above ~5%."""
    g = torch.Generator().manual_seed(1)
    x, y = _unit(torch.randn(2, 6, generator=g, dtype=D))
    sigma = 1.5
    exact = torch.exp(-((x - y) ** 2).sum() / (2 * sigma**2))
    est = []
    for s in range(400):
        part = RandomFeatureAttention(6, 256, sigma=sigma, seed=s, dtype=D)
        est.append(part.features(x) @ part.features(y))
    est = torch.stack(est).detach()
    se = est.std() / math.sqrt(len(est))
    assert abs(est.mean() - exact) <= 4 * se
    assert se < 0.012 * exact


def test_error_against_softmax_over_unit_vectors_falls_with_the_number_of_features():
    q, k, v = _qkv(2, n=48)
    sigma = 1.0
    scores = _unit(q) @ _unit(k).transpose(-1, -2) / sigma**2
    exact = torch.softmax(scores, -1) @ v
    errors = []
    for m in (16, 64, 256, 1024):
        e = []
        for s in range(6):
            out = RandomFeatureAttention(6, m, sigma=sigma, seed=s, dtype=D)(q, k, v).context
            e.append((out - exact).norm() / exact.norm())
        errors.append(float(torch.stack(e).mean().detach()))
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.5 * errors[0], errors


def _gated_loop(part, q, k, v):
    """RFA eq. 7 step by step: S_t = g_t S_{t−1} + (1 − g_t) φ(k_t) v_tᵀ, likewise z_t."""
    out = []
    for b in range(q.shape[0]):
        s = torch.zeros(2 * part.n_features, v.shape[-1], dtype=D)
        z = torch.zeros(2 * part.n_features, dtype=D)
        rows = []
        for t in range(q.shape[1]):
            gt = torch.sigmoid(part.gate_weight @ k[b, t] + part.gate_bias)
            fk, fq = part.features(k[b, t]), part.features(q[b, t])
            s = gt * s + (1 - gt) * torch.outer(fk, v[b, t])
            z = gt * z + (1 - gt) * fk
            rows.append(fq @ s / (fq @ z))
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_gated_causal_equals_the_recurrence(chunk_size):
    q, k, v = (x.requires_grad_() for x in _qkv(3, n=11))
    part = RandomFeatureAttention(6, 32, causal=True, gate=True, chunk_size=chunk_size, dtype=D)
    with torch.no_grad():
        part.gate_weight.normal_(generator=torch.Generator().manual_seed(4))
        part.gate_bias.fill_(0.5)
    out = part(q, k, v, need_weights=True)
    ref = _gated_loop(part, q, k, v)
    torch.testing.assert_close(out.context, ref, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(out.weights @ v, out.context, atol=1e-10, rtol=1e-8)
    r = torch.randn(ref.shape, dtype=D, generator=torch.Generator().manual_seed(5))
    params = (q, k, v, part.gate_weight, part.gate_bias, part.log_sigma)
    for a, b in zip(
        torch.autograd.grad((out.context * r).sum(), params),
        torch.autograd.grad((ref * r).sum(), params),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-7)


def test_ungated_causal_equals_the_prefix_of_the_weights_and_the_receptive_field():
    q, k, v = (x.requires_grad_() for x in _qkv(6, lead=(1,), n=9))
    part = RandomFeatureAttention(6, 32, causal=True, chunk_size=4, dtype=D)
    out = part(q, k, v, need_weights=True)
    s = (part.features(q) @ part.features(k).transpose(-1, -2)).tril()
    torch.testing.assert_close(out.weights, s / s.sum(-1, keepdim=True))
    torch.testing.assert_close(out.context, out.weights @ v)
    for i in range(9):
        grads = torch.autograd.grad(out.context[0, i].sum(), (q, k, v), retain_graph=True)
        assert all((g[0, i + 1 :] == 0).all() for g in grads)


def test_sigma_is_learned_per_dimension():
    part = RandomFeatureAttention(6, 16, sigma=2.0)
    assert part.log_sigma.shape == (6,) and part.log_sigma.requires_grad
    torch.testing.assert_close(part.log_sigma.exp(), torch.full((6,), 2.0))


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="gate=True needs causal=True"):
        RandomFeatureAttention(6, gate=True)
    with pytest.raises(ValueError, match="sigma"):
        RandomFeatureAttention(6, sigma=0.0)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="varies over queries"):
        RandomFeatureAttention(6, dtype=D)(q, k, v, mask=ak.masks.causal(24))
