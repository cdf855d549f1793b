"""Target-then-document attention (Ma et al.; Galassi IV-A2) against a loop."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.features import TargetDocumentAttention


def _softmax(xs):
    ex = [torch.exp(x) for x in xs]
    return [e / sum(ex) for e in ex]


def _additive(score, q, k):
    """wᵀ tanh(W1 q + W2 k + b) (Brauwers eq. 6); no query term when q is None."""
    h = score.W2.weight @ k + score.W2.bias
    if q is not None:
        h = h + score.W1.weight @ q
    return score.w.weight[0] @ torch.tanh(h)


def test_target_context_is_the_query_over_the_document():
    torch.manual_seed(0)
    m = TargetDocumentAttention(4, 3, 5).double()
    target, document = rand(2, 3, 4, seed=1), rand(2, 6, 3, seed=2)
    tmask = ak.masks.from_lengths(torch.tensor([3, 1]), 3)
    dmask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    lengths = [(3, 6), (1, 4)]

    def loop():
        rows = []
        for b, (nt, nw) in enumerate(lengths):
            T, W = list(target[b, :nt]), list(document[b, :nw])
            at = _softmax([_additive(m.target_attention.score, None, k) for k in T])
            ct = sum(w * k for w, k in zip(at, T, strict=True))
            aw = _softmax([_additive(m.document_attention.score, ct, k) for k in W])
            rows.append(sum(w * k for w, k in zip(aw, W, strict=True)))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(target, document, tmask, dmask).context,
        loop,
        [target, document, *m.parameters()],
        atol=1e-12,
        rtol=1e-10,
    )
    out = m(target, document, tmask, dmask)
    assert (out.target_weights[1, 1:] == 0).all() and (out.document_weights[1, 4:] == 0).all()


def test_the_target_score_must_be_query_free():
    with pytest.raises(ValueError, match="query-free"):
        TargetDocumentAttention(4, 3, 5, target_score=ak.scores.Dot())
    m = TargetDocumentAttention(4, 4, target_score=ak.scores.LearnedQuery(4))
    assert m(torch.randn(2, 3, 4), torch.randn(2, 5, 4)).context.shape == (2, 4)
