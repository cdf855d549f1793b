"""Performer / FAVOR+ (Choromanski et al. 2021): the random features are those of Lemma 1, the
kernel estimate is unbiased, the error against exact softmax attention falls with the number of
features, the causal form is a prefix of the weights, and redraws happen when asked."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import Performer

D = torch.float64


def _qkv(seed=0, lead=(2,), n=32, d=8, dv=4, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return (
        scale * torch.randn(*lead, n, d, generator=g, dtype=D),
        scale * torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def _lemma1(x, omega, d):
    """φ(x) = exp(ω·x − ‖x‖²/2)/√m with x = input/d^{1/4} (Performer Lemma 1), unstabilised."""
    x = x / d**0.25
    return torch.exp(x @ omega.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(len(omega))


def test_features_are_lemma_1_up_to_a_constant_that_cancels():
    q, k, _ = _qkv()
    part = Performer(8, 32).to(D)
    for x, is_query in ((q, True), (k, False)):
        ratio = part.features(x, is_query=is_query) / _lemma1(x, part.omega, 8)
        # queries: one constant per row; keys: one constant per sequence
        dims = (-1,) if is_query else (-1, -2)
        torch.testing.assert_close(ratio, ratio.mean(dims, keepdim=True).expand_as(ratio))


def test_orthogonal_blocks_and_gaussian_norms():
    part = Performer(8, 20, dtype=D)  # drawn in float64 and kept so
    w = part.omega
    for block in (w[:8], w[8:16], w[16:]):
        gram = block @ block.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-10  # rows orthogonal within a block
    assert not torch.allclose(w[:8].norm(dim=-1), w[:8].norm(dim=-1)[0])  # norms vary


@pytest.mark.parametrize("orthogonal", [True, False])
def test_the_kernel_estimate_is_unbiased(orthogonal):
    """Mean of φ(q)·φ(k) over 400 independent draws of 128 features vs exp(q·k/√d). The draws
    are independent, so the mean's standard error is SE = std/√400, and |error| ≤ 4 SE fails with
    probability < 1e-4 for an unbiased estimator (the mean is close to normal at 400 draws); with
    SE < 1.2% of the kernel, any bias above ~5% of it is caught."""
    g = torch.Generator().manual_seed(1)
    q, k = 0.6 * torch.randn(2, 8, generator=g, dtype=D)
    exact = torch.exp(q @ k / math.sqrt(8))
    estimates = torch.stack(
        [
            _lemma1(q, w, 8) @ _lemma1(k, w, 8)
            for w in (
                Performer(8, 128, orthogonal=orthogonal, seed=s, dtype=D).omega for s in range(400)
            )
        ]
    )
    se = estimates.std() / math.sqrt(len(estimates))
    assert abs(estimates.mean() - exact) <= 4 * se
    assert se < 0.012 * exact  # the tolerance is tight enough to mean something


def test_error_against_softmax_attention_falls_with_the_number_of_features():
    """Mean over 6 seeds of the relative error of the context; the estimator's variance is
    O(1/m), so the error falls steadily with m."""
    q, k, v = _qkv(2, n=64)
    exact = ak.attention(q, k, v).context
    errors = []
    for m in (8, 32, 128, 512):
        e = [
            (Performer(8, m, seed=s).to(D)(q, k, v).context - exact).norm() / exact.norm()
            for s in range(6)
        ]
        errors.append(float(torch.stack(e).mean()))
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.5 * errors[0], errors


def test_causal_is_a_prefix_of_the_weights_and_has_a_causal_receptive_field():
    q, k, v = (x.requires_grad_() for x in _qkv(3, lead=(1,), n=10))
    part = Performer(8, 64, causal=True, chunk_size=4).to(D)
    out = part(q, k, v, need_weights=True)
    fq, fk = _lemma1(q, part.omega, 8), _lemma1(k, part.omega, 8)
    s = (fq @ fk.transpose(-1, -2)).tril()
    ref = s / s.sum(-1, keepdim=True)
    torch.testing.assert_close(out.weights, ref)
    torch.testing.assert_close(out.context, ref @ v)
    for i in range(10):
        grads = torch.autograd.grad(out.context[0, i].sum(), (q, k, v), retain_graph=True)
        assert all((g[0, i + 1 :] == 0).all() for g in grads)
        assert grads[2][0, : i + 1].abs().sum(-1).gt(0).all()


def test_relu_kernel_is_generalised_attention_with_relu():
    q, k, v = _qkv(4, n=12)
    part = Performer(8, 24, kernel="relu").to(D)
    out = part(q, k, v, need_weights=True)
    fq, fk = torch.relu(q @ part.omega.T), torch.relu(k @ part.omega.T)
    s = fq @ fk.transpose(-1, -2)
    torch.testing.assert_close(out.weights, s / s.sum(-1, keepdim=True))
    torch.testing.assert_close(out.context, out.weights @ v)


def test_redraw_every_n_training_calls_and_never_in_eval():
    q, k, v = _qkv(5, n=6)
    part = Performer(8, 16, redraw_every=2).to(D)
    first = part.omega.clone()
    part.eval()
    for _ in range(5):
        part(q, k, v)
    assert torch.equal(part.omega, first)
    part.train()
    part(q, k, v)
    part(q, k, v)
    assert torch.equal(part.omega, first)
    part(q, k, v)  # third training call: new features
    assert not torch.equal(part.omega, first)
    second = part.omega.clone()
    part.redraw()
    assert not torch.equal(part.omega, second)


def test_large_logits_stay_finite_in_float32():
    """The stabilisers keep exp() in range where the unstabilised features overflow."""
    q, k, v = _qkv(6, n=16, scale=12.0)
    part = Performer(8, 64)
    unstabilised = _lemma1(k.float(), part.omega, 8)
    assert not torch.isfinite(unstabilised).all() or (unstabilised == 0).any()
    out = part(q.float(), k.float(), v.float())
    assert torch.isfinite(out.context).all()
    ref = part.to(D)(q, k, v).context
    torch.testing.assert_close(out.context.double(), ref, atol=1e-4, rtol=1e-4)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="kernel"):
        Performer(8, kernel="gaussian")
    with pytest.raises(ValueError, match="n_features"):
        Performer(8, 0)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"Performer\(head_dim=4\) got q with 8 features"):
        Performer(4)(q, k, v)
