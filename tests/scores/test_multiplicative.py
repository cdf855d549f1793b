"""Multiplicative scores against loops written from Brauwers Table II."""

import math

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit import scores as sc


def _loop(q, k, pair):
    b, m, n = q.shape[0], q.shape[1], k.shape[1]
    return torch.stack(
        [
            torch.stack([torch.stack([pair(q[i, a], k[i, c]) for c in range(n)]) for a in range(m)])
            for i in range(b)
        ]
    )


def test_dot():
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert_same_forward_backward(lambda: sc.Dot()(q, k), lambda: _loop(q, k, torch.dot), [q, k])


def test_scaled_dot():
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    assert_same_forward_backward(
        lambda: sc.ScaledDot()(q, k),
        lambda: _loop(q, k, lambda x, y: torch.dot(x, y) / math.sqrt(4)),
        [q, k],
    )


def test_general():
    torch.manual_seed(0)
    s = sc.General(5, 4).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W = s.W.weight  # (d_k, d_q)
    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, lambda x, y: y @ (W @ x)), [q, k, W]
    )


def test_biased_general():
    torch.manual_seed(0)
    s = sc.BiasedGeneral(5, 4).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, bias = s.W.weight, s.W.bias
    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, lambda x, y: y @ (W @ x + bias)), [q, k, W, bias]
    )


@pytest.mark.parametrize("act", ["tanh", "relu", "selu"])
def test_activated_general(act):
    torch.manual_seed(0)
    s = sc.ActivatedGeneral(5, 4, activation=act).double()
    with torch.no_grad():
        s.b.fill_(0.3)
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, b = s.W.weight, s.b
    f = {"tanh": torch.tanh, "relu": torch.relu, "selu": torch.selu}[act]
    assert_same_forward_backward(
        lambda: s(q, k), lambda: _loop(q, k, lambda x, y: f(y @ W @ x + b)), [q, k, W, b]
    )


@pytest.mark.parametrize("cls", [sc.General, sc.BiasedGeneral, sc.ActivatedGeneral])
def test_per_head_parameters_equal_one_score_per_head(cls):
    torch.manual_seed(0)
    heads = cls(5, 4, num_heads=3).double()
    q, k = rand(2, 3, 4, 5, seed=1, grad=False), rand(2, 3, 6, 4, seed=2, grad=False)
    e = heads(q, k)
    for h in range(3):
        one = cls(5, 4).double()
        with torch.no_grad():
            one.W.weight.copy_(heads.W.weight[h])
            if one.W.bias is not None:
                one.W.bias.copy_(heads.W.bias[h])
            if hasattr(one, "b"):
                one.b.copy_(heads.b[h, 0, 0])
        torch.testing.assert_close(e[:, h], one(q[:, h], k[:, h]))


@pytest.mark.parametrize("cls", [sc.Dot, sc.ScaledDot, sc.General, sc.BiasedGeneral])
def test_dot_form_reproduces_scores(cls):
    torch.manual_seed(0)
    s = cls() if cls in (sc.Dot, sc.ScaledDot) else cls(4, 4)
    s = s.double()
    q, k = rand(2, 3, 4, seed=1, grad=False), rand(2, 6, 4, seed=2, grad=False)
    qp, kp, scale = s.dot_form(q, k)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), s(q, k))


def test_dot_needs_equal_sizes():
    with pytest.raises(ValueError, match=r"d_q == d_k.*\(2, 3, 5\).*\(2, 6, 4\)"):
        sc.Dot()(torch.randn(2, 3, 5), torch.randn(2, 6, 4))


@pytest.mark.parametrize("cls", [sc.Dot, sc.ScaledDot])
def test_softcap_is_c_tanh_of_the_scores_and_equals_the_score_mod_form(cls):
    """Gemma 2's logit soft-capping: e ↦ c·tanh(e / c), written out, and as a score_mod."""
    q, k = rand(2, 3, 4, 8, seed=1, grad=False) * 4, rand(2, 3, 6, 8, seed=2, grad=False) * 4
    v = rand(2, 3, 6, 5, seed=3, grad=False)
    capped = cls(softcap=2.5)
    plain = q @ k.transpose(-1, -2) / (8**0.5 if cls is sc.ScaledDot else 1.0)
    torch.testing.assert_close(capped(q, k), 2.5 * torch.tanh(plain / 2.5))
    assert capped(q, k).abs().max() <= 2.5 < plain.abs().max()
    pad = ak.masks.from_lengths(torch.tensor([6, 4]), 6)[:, None]
    out = ak.attention(q, k, v, score=capped, mask=pad).context
    mod = ak.attention(
        q, k, v, score=cls(), mask=pad,
        score_mod=lambda e, b, h, qi, ki: 2.5 * torch.tanh(e / 2.5),
    ).context  # fmt: skip
    torch.testing.assert_close(out, mod, atol=1e-12, rtol=1e-12)
    chunked = ak.attention(q, k, v, score=capped, mask=pad, chunk_size=4).context
    torch.testing.assert_close(chunked, out)


def test_softcap_is_not_a_dot_product_for_sdpa_and_is_checked():
    assert sc.ScaledDot().dot_product_form and not sc.ScaledDot(softcap=30.0).dot_product_form
    q = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match="sdpa"):
        ak.attention(q, q, score=sc.ScaledDot(softcap=30.0), kernel="sdpa")
    with pytest.raises(ValueError, match="softcap must be > 0"):
        sc.ScaledDot(softcap=0.0)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        sc.ScaledDot(softcap="30")
