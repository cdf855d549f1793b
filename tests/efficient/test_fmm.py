"""FMMformer (Nguyen et al. 2021): the near field is softmax over the band |i − j| ≤ w and the
far field is linear attention with the sum of the feature maps' kernels, both written out by
loops below; V̂ = w₁ near + w₂ far; w ≥ N with w₂ = 0 is softmax attention; the causal form has a
causal receptive field."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from flag_task import flag_retrieval_accuracy

import attnkit as ak
from attnkit.efficient import FMMformer

D = torch.float64


def _qkv(seed=0, lead=(2,), n=9, d=4, dv=3):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def _near(q, k, v, w, causal=False, keep=None):
    """Banded softmax, one query and one key at a time (float64)."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=D)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            js = [
                j
                for j in range(k.shape[1])
                if abs(i - j) <= w and (not causal or j <= i) and (keep is None or keep[b, j])
            ]
            if not js:  # no key in the band: weights 0, context 0
                continue
            s = torch.stack([q[b, i] @ k[b, j] / math.sqrt(q.shape[-1]) for j in js])
            a = torch.exp(s - s.max())
            out[b, i] = sum(ai * v[b, j] for ai, j in zip(a / a.sum(), js, strict=True))
    return out


def _far(q, k, v, phis, causal=False):
    """Linear attention with sim(q, k) = Σ_l φ_l(q)·φ_l(k), pair by pair (float64)."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=D)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            js = range(i + 1) if causal else range(k.shape[1])
            sims = [sum(p(q[b, i]) @ p(k[b, j]) for p in phis) for j in js]
            out[b, i] = sum(s * v[b, j] for s, j in zip(sims, js, strict=True)) / sum(sims)
    return out


def _elu1(x):
    return F.elu(x) + 1


def test_near_field_is_banded_softmax():
    q, k, v = _qkv()
    part = FMMformer(2, near_weight=1.0, far_weight=0.0).to(D)
    out = part(q, k, v, need_weights=True)
    torch.testing.assert_close(out.context, _near(q, k, v, 2))
    band = (torch.arange(9)[:, None] - torch.arange(9)).abs() <= 2
    near = out.extra["near"]
    assert (near[..., ~band] == 0).all()
    torch.testing.assert_close(near.sum(-1), torch.ones(2, 9, dtype=D))


@pytest.mark.parametrize(("m", "n"), [(4, 9), (13, 9), (2, 40)])
def test_near_field_with_more_or_fewer_queries_than_keys(m, n):
    """The band is over indices: query i sees keys |i − j| ≤ w that exist."""
    q, _, _ = _qkv(6, n=m)
    _, k, v = _qkv(7, n=n)
    part = FMMformer(3, near_weight=1.0, far_weight=0.0).to(D)
    torch.testing.assert_close(part(q, k, v).context, _near(q, k, v, 3))


def test_wide_band_without_far_field_is_softmax_attention():
    q, k, v = _qkv(1)
    for w in (8, 50):
        part = FMMformer(w, near_weight=1.0, far_weight=0.0).to(D)
        torch.testing.assert_close(part(q, k, v).context, ak.attention(q, k, v).context)


@pytest.mark.parametrize(
    ("names", "maps"),
    [(("elu+1", "relu"), (_elu1, F.relu)), (("elu+1", "elu(-x)+1"), (_elu1, lambda x: _elu1(-x)))],
)
def test_far_field_sums_the_feature_maps_kernels_and_the_fields_blend_linearly(names, maps):
    q, k, v = _qkv(2)
    part = FMMformer(1, names, near_weight=0.3, far_weight=0.9).to(D)
    far = _far(q, k, v, maps)
    torch.testing.assert_close(part(q, k, v).context, 0.3 * _near(q, k, v, 1) + 0.9 * far)


def test_causal_form_and_its_receptive_field():
    q, k, v = (x.requires_grad_() for x in _qkv(3, lead=(1,)))
    part = FMMformer(2, causal=True, chunk_size=4).to(D)
    out = part(q, k, v, need_weights=True)
    ref = 0.5 * _near(q, k, v, 2, causal=True) + 0.5 * _far(q, k, v, (_elu1,), causal=True)
    torch.testing.assert_close(out.context, ref)
    assert (out.weights[0].triu(1) == 0).all()
    for i in range(9):
        grads = torch.autograd.grad(out.context[0, i].sum(), (q, k, v), retain_graph=True)
        assert all((g[0, i + 1 :] == 0).all() for g in grads)


def test_key_padding_in_both_fields_and_padded_queries_get_zero():
    q, k, v = _qkv(4)
    keep = ak.masks.from_lengths(torch.tensor([9, 6]), 9)[:, 0]
    part = FMMformer(2, near_weight=1.0, far_weight=0.0).to(D)
    out = part(q, k, v, mask=keep[:, None, :])
    torch.testing.assert_close(out.context, _near(q, k, v, 2, keep=keep))
    out = FMMformer(2).to(D)(q, k, v, mask=keep[:, :, None] & keep[:, None, :])
    assert (out.context[1, 6:] == 0).all()


def test_refuses_other_masks_and_bias_and_fits_the_attention_slot():
    q, k, v = _qkv(5)
    part = FMMformer(2).to(D)
    with pytest.raises(ValueError, match="FMMformer: the mask varies over queries"):
        part(q, k, v, mask=ak.masks.causal(9))
    with pytest.raises(ValueError, match="bias"):
        part(q, k, v, bias=torch.zeros(9, 9, dtype=D))
    with pytest.raises(ValueError, match="feature_maps"):
        FMMformer(2, "elu+1")
    mha = ak.MultiHeadAttention(8, 2, attention=FMMformer(3, causal=True)).to(D)
    x = torch.randn(2, 12, 8, dtype=D)
    assert mha(x, x, x).context.shape == (2, 12, 8)


@pytest.mark.slow
def test_learns_flag_retrieval():
    """Inside MultiHeadAttention it learns the flag-retrieval task (chance 1/8)."""
    assert flag_retrieval_accuracy(FMMformer(4)) > 0.9
