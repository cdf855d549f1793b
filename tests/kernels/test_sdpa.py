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
