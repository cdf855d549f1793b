"""Fine-grained co-attention with any score as co-compatibility function, and the linear and
nested-perceptron aggregations (Galassi IV-D2), against loops over feature pairs."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.features import ParallelCoAttention
from attnkit.features.aggregation import LinearAggregation, NestedPerceptronAggregation


def softmax(xs):
    ex = [torch.exp(x) for x in xs]
    s = sum(ex)
    return [e / s for e in ex]


def weighted(ws, fs):
    return sum(w * f for w, f in zip(ws, fs, strict=True))


def _inputs(d1=6, d2=3):
    return rand(2, 5, d1, seed=1), rand(2, 4, d2, seed=2)


def _pair_score(score, x, y):
    """The score of one (query, key) pair, called on (1, 1, d) tensors."""
    return score(x[None, None], y[None, None])[0, 0, 0]


SCORES = {
    "scaled_dot": lambda: ak.scores.ScaledDot(),
    "general": lambda: ak.scores.General(6, 6),
    "cosine": lambda: ak.scores.Cosine(),
    "additive": lambda: ak.scores.Additive(6, 6, 4),
    "hermitian": lambda: ak.scores.Hermitian(6, 3),
}


@pytest.mark.parametrize("name", list(SCORES))
def test_any_score_is_a_co_compatibility_function(name):
    """E_ij = score(f⁽¹⁾_i, f⁽²⁾_j) for any registered score, then max pooling (eq. 16)."""
    torch.manual_seed(0)
    score = SCORES[name]().double()
    m = ParallelCoAttention(6, 6, affinity=score, score="max")
    f1, f2 = _inputs(d2=6)

    def loop():
        rows = []
        for b in range(2):
            F1, F2 = list(f1[b]), list(f2[b])
            aff = [[_pair_score(score, x, y) for y in F2] for x in F1]
            value = lambda t: float(t.detach())  # noqa: E731
            e1 = [max(row, key=value) for row in aff]
            e2 = [max((aff[i][j] for i in range(len(F1))), key=value) for j in range(len(F2))]
            rows.append(torch.cat([weighted(softmax(e1), F1), weighted(softmax(e2), F2)]))
        return torch.stack(rows)

    params = [f1, f2, *score.parameters()]
    assert_same_forward_backward(lambda: m(f1, f2).concat(), loop, params, atol=1e-12, rtol=1e-10)


def test_hermitian_co_attention_roles():
    """Swapping F1 and F2 transposes the real Hermitian affinity (the score keeps only Re)."""
    torch.manual_seed(0)
    score = ak.scores.Hermitian(6, 3).double()
    m = ParallelCoAttention(6, 6, affinity=score, score="max")
    f1, f2 = _inputs(d2=6)
    torch.testing.assert_close(m.affinity_matrix(f2, f1), m.affinity_matrix(f1, f2).mT)
    swapped = m(f2, f1)
    out = m(f1, f2)
    torch.testing.assert_close(swapped.weights1, out.weights2)
    torch.testing.assert_close(swapped.weights2, out.weights1)


def test_linear_aggregation_loop():
    torch.manual_seed(0)
    agg = LinearAggregation(6, 3).double()
    m = ParallelCoAttention(6, 3, affinity=ak.scores.General(6, 3).double(), score=agg)
    f1, f2 = _inputs()
    W = m.affinity.W.weight

    def loop():
        rows = []
        for b in range(2):
            F1, F2 = list(f1[b]), list(f2[b])
            aff = [[y @ (W @ x) for y in F2] for x in F1]  # general score: kᵀ W q
            e1 = [sum(aff[i][j] * (agg.w2.weight[0] @ F2[j]) for j in range(4)) for i in range(5)]
            e2 = [sum(aff[i][j] * (agg.w1.weight[0] @ F1[i]) for i in range(5)) for j in range(4)]
            rows.append(torch.cat([weighted(softmax(e1), F1), weighted(softmax(e2), F2)]))
        return torch.stack(rows)

    params = [f1, f2, *m.parameters()]
    assert_same_forward_backward(lambda: m(f1, f2).concat(), loop, params, atol=1e-12, rtol=1e-10)


def test_nested_perceptron_aggregation_loop():
    torch.manual_seed(0)
    agg = NestedPerceptronAggregation(6, 3, 4).double()
    m = ParallelCoAttention(6, 3, affinity=ak.scores.General(6, 3).double(), score=agg)
    f1, f2 = _inputs()
    W = m.affinity.W.weight

    def loop():
        rows = []
        for b in range(2):
            F1, F2 = list(f1[b]), list(f2[b])
            aff = [[y @ (W @ x) for y in F2] for x in F1]
            M1 = [softmax(row) for row in aff]  # each F1 feature over F2
            cols = [softmax([aff[i][j] for i in range(5)]) for j in range(4)]  # each F2 over F1
            e1 = [
                agg.w1.weight[0]
                @ torch.tanh(
                    agg.W1.weight @ F1[i]
                    + sum(M1[i][j] * (agg.W2.weight @ F2[j]) for j in range(4))
                )
                for i in range(5)
            ]
            e2 = [
                agg.w2.weight[0]
                @ torch.tanh(
                    agg.W2.weight @ F2[j]
                    + sum(cols[j][i] * (agg.W1.weight @ F1[i]) for i in range(5))
                )
                for j in range(4)
            ]
            rows.append(torch.cat([weighted(softmax(e1), F1), weighted(softmax(e2), F2)]))
        return torch.stack(rows)

    params = [f1, f2, *m.parameters()]
    assert_same_forward_backward(lambda: m(f1, f2).concat(), loop, params, atol=1e-12, rtol=1e-10)


def test_scores_that_cannot_be_co_compatibilities_are_refused():
    with pytest.raises(ValueError, match="query-free"):
        ParallelCoAttention(6, 3, affinity=ak.scores.Additive(None, 3, 4))
    with pytest.raises(ValueError, match="multi-dimensional"):
        ParallelCoAttention(6, 3, affinity=ak.scores.Additive(6, 3, 4, d_out=2))
    with pytest.raises(ValueError, match="Score module"):
        ParallelCoAttention(6, 3, affinity="hermitian")
    with pytest.raises(ValueError, match="aggregation module"):
        ParallelCoAttention(6, 3, score="linear")
