"""Meta-embeddings against a loop from Brauwers eqs. 21-22."""

import pytest
import torch
from features.test_coattention import additive, softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.features import MetaEmbedding


def test_eqs_21_22():
    torch.manual_seed(0)
    m = MetaEmbedding([3, 5], 4, 6, dtype=torch.float64)
    e1, e2 = rand(2, 3, 3, seed=1), rand(2, 3, 5, seed=2)

    def loop():
        rows = []
        for b in range(2):
            for t in range(3):
                xs = [
                    p.weight @ e[b, t] + p.bias for p, e in zip(m.project, (e1, e2), strict=True)
                ]  # eq. 21
                a = softmax([additive(m.attention.score, None, x) for x in xs])
                rows.append(weighted(a, xs))  # eq. 22
        return torch.stack(rows).reshape(2, 3, 4)

    assert_same_forward_backward(
        lambda: m([e1, e2]).embedding, loop, [e1, e2, *m.parameters()], atol=1e-12, rtol=1e-12
    )


def test_wrong_number_of_embeddings():
    with pytest.raises(ValueError, match="expected 2 embeddings, got 1"):
        MetaEmbedding([3, 5], 4)([torch.randn(1, 3)])


def test_batch_equals_items():
    # No padding mask (every representation of every token takes part): items alone.
    torch.manual_seed(0)
    m = MetaEmbedding([3, 5], 4, 6).double()
    e1, e2 = rand(3, 2, 3, seed=1, grad=False), rand(3, 2, 5, seed=2, grad=False)
    out = m([e1, e2]).embedding
    for b in range(3):
        torch.testing.assert_close(out[b : b + 1], m([e1[b : b + 1], e2[b : b + 1]]).embedding)


def test_bad_embeddings_are_named():
    m = MetaEmbedding([3, 5], 4)
    with pytest.raises(ValueError, match=r"embeddings\[1\] has 4 features .* dims\[1\] = 5"):
        m([torch.randn(2, 3), torch.randn(2, 4)])
    with pytest.raises(ValueError, match=r"embeddings\[1\] has leading dims \(3,\)"):
        m([torch.randn(2, 3), torch.randn(3, 5)])
    with pytest.raises(TypeError, match=r"embeddings must be a list of 2 tensors"):
        m(torch.randn(2, 3))
    with pytest.raises(TypeError, match=r"embeddings\[0\] must be a floating-point tensor"):
        m([torch.ones(2, 3, dtype=torch.long), torch.randn(2, 5)])
