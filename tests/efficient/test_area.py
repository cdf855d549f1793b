"""Area attention (Li et al. 2019) against a loop over every (start, size) area: mean key, summed
value, softmax over the areas."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import AreaAttention

D = torch.float64


def _reference(q, k, v, max_area, lengths):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=D)
    for b in range(q.shape[0]):
        n = int(lengths[b])
        spans = [(j, s) for s in range(1, max_area + 1) for j in range(n - s + 1)]
        keys = [k[b, j : j + s].mean(0) for j, s in spans]
        values = [v[b, j : j + s].sum(0) for j, s in spans]
        for i in range(q.shape[1]):
            e = torch.stack([q[b, i] @ kk / math.sqrt(q.shape[-1]) for kk in keys])
            a = torch.softmax(e, 0)
            out[b, i] = sum(a[t] * values[t] for t in range(len(spans)))
    return out


@pytest.mark.parametrize("max_area", [1, 2, 4])
def test_equals_the_loop_over_areas(max_area):
    g = torch.Generator().manual_seed(max_area)
    q, k, v = (torch.randn(2, n, 3, generator=g, dtype=D) for n in (5, 8, 8))
    lengths = torch.tensor([8, 5])
    part = AreaAttention(max_area)
    out = part(q, k, v, mask=ak.masks.from_lengths(lengths, 8), need_weights=True)
    torch.testing.assert_close(out.context, _reference(q, k, v, max_area, lengths))
    n_areas = sum(8 - s + 1 for s in range(1, max_area + 1))
    assert out.weights.shape == (2, 5, n_areas)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 5, dtype=D))


def test_max_area_one_is_plain_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=D) for _ in range(3))
    mask = ak.masks.causal(6)
    out = AreaAttention(1)(q, k, v, mask=mask, need_weights=True)
    ref = ak.attention(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out.context, ref.context)
    torch.testing.assert_close(out.weights, ref.weights)


def test_areas_longer_than_the_sequence_and_in_multi_head_attention():
    mha = ak.MultiHeadAttention(8, 2, attention=AreaAttention(5))
    out = mha(torch.randn(2, 3, 8), need_weights=True)  # areas of 1 … 3 keys only
    assert out.weights.shape == (2, 2, 3, 3 + 2 + 1)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_area"):
        AreaAttention(0)
    q = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"AreaAttention.*accepts_bias"):
        AreaAttention(2)(q, q, q, bias=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="k of shape"):
        AreaAttention(2)(q, q, torch.randn(2, 5, 3))
