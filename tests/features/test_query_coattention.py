"""Alternating co-attention with an external query (Sordoni et al.) against a loop."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.features import QueryGuidedCoAttention


def _softmax(xs):
    ex = [torch.exp(x) for x in xs]
    return [e / sum(ex) for e in ex]


def _biased_general(score, q, k):
    """kᵀ (W q + b) (Sordoni et al.; Galassi Table IV)."""
    return k @ (score.W.weight @ q + score.W.bias)


def test_question_then_document_glimpse_with_the_query():
    torch.manual_seed(0)
    m = QueryGuidedCoAttention(6, 3, 4).double()
    f1, f2, q = rand(2, 5, 6, seed=1), rand(2, 4, 3, seed=2), rand(2, 4, seed=3)
    mask1 = ak.masks.from_lengths(torch.tensor([5, 2]), 5)
    mask2 = ak.masks.from_lengths(torch.tensor([3, 4]), 4)
    lengths = [(5, 3), (2, 4)]

    def loop():
        rows = []
        for b, (n1, n2) in enumerate(lengths):
            F1, F2 = list(f1[b, :n1]), list(f2[b, :n2])
            a1 = _softmax([_biased_general(m.att1.score, q[b], k) for k in F1])
            c1 = sum(w * k for w, k in zip(a1, F1, strict=True))
            query2 = torch.cat([q[b], c1])  # the query joins the first context
            a2 = _softmax([_biased_general(m.att2.score, query2, k) for k in F2])
            c2 = sum(w * k for w, k in zip(a2, F2, strict=True))
            rows.append(torch.cat([c1, c2]))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(f1, f2, q, mask1, mask2).concat(),
        loop,
        [f1, f2, q, *m.parameters()],
        atol=1e-12,
        rtol=1e-10,
    )


def test_the_query_steers_both_glimpses():
    torch.manual_seed(0)
    m = QueryGuidedCoAttention(6, 3, 4).double()
    f1, f2 = rand(1, 5, 6, seed=1, grad=False), rand(1, 4, 3, seed=2, grad=False)
    a, b = (
        m(f1, f2, torch.zeros(1, 4, dtype=torch.float64)),
        m(f1, f2, 3 * torch.ones(1, 4).double()),
    )
    assert not torch.allclose(a.weights1, b.weights1) and not torch.allclose(a.weights2, b.weights2)


def test_any_score_and_bad_query():
    m = QueryGuidedCoAttention(6, 3, 4, score1=ak.scores.Additive(4, 6, 5))
    assert isinstance(m.att1.score, ak.scores.Additive)
    with pytest.raises(ValueError, match=r"query has 5 features"):
        m(torch.randn(2, 5, 6), torch.randn(2, 4, 3), torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"query must be \(B, d\)"):
        m(torch.randn(2, 5, 6), torch.randn(2, 4, 3), torch.randn(2, 1, 4))
