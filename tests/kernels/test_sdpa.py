"""The SDPA dispatch computes what the dense path computes, for every dot-product-form score."""

import pytest
import torch
from helpers import rand

from attnkit import alignments as al
from attnkit import scores as sc
from attnkit.kernels import dense, sdpa

DOT_FORM = {
    "dot": lambda: sc.Dot(),
    "scaled_dot": lambda: sc.ScaledDot(),
    "general": lambda: sc.General(4, 4),
    "biased_general": lambda: sc.BiasedGeneral(4, 4),
    "cosine": lambda: sc.Cosine(),
    "learned_query": lambda: sc.LearnedQuery(4, scaled=True),
    "hermitian": lambda: sc.Hermitian(4, 3),
    "directed_hermitian": lambda: sc.DirectedHermitian(4, 3),
    "decomposable": lambda: sc.Decomposable(4, 4, 3, activation="tanh"),
    "decomposable_shared": lambda: sc.SharedDecomposable(4, 3, activation="tanh"),
}


def test_every_dot_form_score_is_listed():
    listed = {n for n in sc.available() if sc.REGISTRY.get(n).dot_product_form}
    assert listed == set(DOT_FORM)


@pytest.mark.parametrize("name", list(DOT_FORM))
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sdpa_equals_dense(name, temperature):
    torch.manual_seed(0)
    score = DOT_FORM[name]().double()
    align = al.Softmax(temperature)
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 6, 4, seed=2), rand(2, 6, 5, seed=3)
    mask = torch.ones(2, 3, 6, dtype=torch.bool)
    mask[0, :, 4:] = False
    mask[1, 2] = False  # a fully masked row
    bias = rand(3, 6, seed=4, grad=False)
    assert sdpa.can_dispatch(score, align, need_weights=False)
    fast = sdpa.attend(q, k, v, score, align, mask=mask, bias=bias).context
    slow = dense.attend(q, k, v, score, align, mask=mask, bias=bias).context
    torch.testing.assert_close(fast, slow)
    r = torch.randn_like(fast)
    wrt = [k, v, *score.parameters()] if score.query_free else [q, k, v, *score.parameters()]
    g1 = torch.autograd.grad((fast * r).sum(), wrt)
    g2 = torch.autograd.grad((slow * r).sum(), wrt)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_no_dispatch_when_it_would_differ():
    assert not sdpa.can_dispatch(sc.ScaledDot(), al.Softmax(), need_weights=True)
    assert not sdpa.can_dispatch(sc.ScaledDot(), al.Sparsemax(), need_weights=False)
    assert not sdpa.can_dispatch(sc.ScaledDot(), al.Softmax(learnable=True), need_weights=False)
    assert not sdpa.can_dispatch(sc.Additive(4, 4, 4), al.Softmax(), need_weights=False)


def _recording(monkeypatch):
    calls = []
    real = sdpa.F.scaled_dot_product_attention

    def record(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", record)
    return calls


@pytest.mark.parametrize("shape", [(7, 7), (1, 1, 7, 7)])
def test_the_causal_mask_goes_to_sdpas_causal_mode_and_equals_dense(monkeypatch, shape):
    """Exactly the causal mask (any broadcast shape of ones) runs SDPA with is_causal=True and
    no mask: equal to the dense path, values and gradients, in float64."""
    calls = _recording(monkeypatch)
    score, align = sc.ScaledDot(), al.Softmax()
    causal = torch.ones(7, 7, dtype=torch.bool).tril().reshape(shape)
    q, k, v = rand(2, 3, 7, 4, seed=1), rand(2, 3, 7, 4, seed=2), rand(2, 3, 7, 5, seed=3)
    got = sdpa.attend(q, k, v, score, align, mask=causal).context
    assert calls[-1]["is_causal"] is True and calls[-1].get("attn_mask") is None
    want = dense.attend(q, k, v, score, align, mask=causal).context
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    r = torch.randn(want.shape, dtype=want.dtype)
    grads = torch.autograd.grad((got * r).sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad((want * r).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_masks_that_are_not_exactly_causal_keep_the_mask(monkeypatch):
    """Causal with padding, a causal mask given per batch item (not broadcast), a shifted
    triangle (M ≠ N, decoding after a cache) and a causal mask with a bias keep SDPA's masked
    form."""
    calls = _recording(monkeypatch)
    score, align = sc.ScaledDot(), al.Softmax()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    padded = causal & torch.tensor([True] * 5 + [False])
    per_item = causal.expand(2, 6, 6)
    shifted = torch.ones(3, 6, dtype=torch.bool).tril(3)
    q, k, v = rand(2, 6, 4, seed=1), rand(2, 6, 4, seed=2), rand(2, 6, 4, seed=3)
    for mask, queries in ((padded, q), (per_item, q), (shifted, q[:, 3:])):
        got = sdpa.attend(queries, k, v, score, align, mask=mask).context
        assert not calls[-1].get("is_causal", False)
        want = dense.attend(queries, k, v, score, align, mask=mask).context
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    bias = rand(6, 6, seed=4, grad=False)
    sdpa.attend(q, k, v, score, align, mask=causal, bias=bias)
    assert not calls[-1].get("is_causal", False)
