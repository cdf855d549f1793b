"""Importance-matrix attention (Lin et al.) and the Frobenius penalty."""

import pytest
import torch
from features.batching import assert_batch_equals_items
from features.test_coattention import softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.queries import ImportanceMatrixAttention, LabelWiseAttention, frobenius_penalty


def test_importance_matrix():
    torch.manual_seed(0)
    m = ImportanceMatrixAttention(4, 5, 3, dtype=torch.float64)
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

    assert_same_forward_backward(
        lambda: m(k).contexts, loop, [k, *m.parameters()], atol=1e-12, rtol=1e-12
    )


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


@pytest.mark.parametrize("cls", [ImportanceMatrixAttention, LabelWiseAttention])
def test_batch_equals_items_with_masks_from_lengths(cls):
    torch.manual_seed(0)
    m = cls(4, 5, 3).double()
    k, v = rand(3, 6, 4, seed=1, grad=False), rand(3, 6, 2, seed=2, grad=False)
    assert_batch_equals_items(
        lambda xs, ms: m(xs[0], xs[1], ms[0]).contexts, [k, v], [[6, 3, 1], [6, 3, 1]]
    )


def test_refuses_masks_and_inputs_that_do_not_fit():
    m = ImportanceMatrixAttention(4, 5, 3)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 6, 6\) does not fit keys"):
        m(torch.randn(2, 6, 4), mask=torch.ones(2, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"values has 5 rows .* keys has 6"):
        m(torch.randn(2, 6, 4), torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match=r"keys has 3 features .* d_k = 4"):
        m(torch.randn(2, 6, 3))
