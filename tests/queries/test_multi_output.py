"""Importance-matrix attention (Lin et al.) and the Frobenius penalty."""

import torch
from features.test_coattention import softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.queries import ImportanceMatrixAttention, LabelWiseAttention, frobenius_penalty


def test_importance_matrix():
    torch.manual_seed(0)
    m = ImportanceMatrixAttention(4, 5, 3).double()
    k = rand(2, 6, 4, seed=1)
    s = m.score

    def loop():
        rows = []
        for b in range(2):
            K = list(k[b])
            hs = [torch.tanh(s.W2.weight @ x + s.W2.bias) for x in K]
            rows.append(
                torch.stack(
                    [weighted(softmax([s.w.weight[r] @ h for h in hs]), K) for r in range(3)]
                )
            )
        return torch.stack(rows)

    assert_same_forward_backward(lambda: m(k).contexts, loop, [k, *m.parameters()])


def test_frobenius_penalty():
    a = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    assert float(frobenius_penalty(a)) == 0.0
    b = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    # AAᵀ = [[.5, .5], [.5, .5]]; minus I: [[-.5, .5], [.5, -.5]]; squared sum = 1.
    torch.testing.assert_close(frobenius_penalty(b), torch.tensor(1.0))


def test_label_wise_is_one_distribution_per_label():
    m = LabelWiseAttention(4, 5, n_labels=7)
    out = m(torch.randn(2, 6, 4))
    assert out.weights.shape == (2, 7, 6)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 7))
