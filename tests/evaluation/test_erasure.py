"""Erasure (Serrano & Smith) on a hand-made voting model, and on an attention model against
removing the items from the input."""

import pytest
import torch
from toy_models import pooled

from attnkit.evaluation.erasure import erasure, random_order


def votes(x, keep):
    return (x * keep.unsqueeze(-1)).sum(1)


X = torch.tensor([[[2.0, 0.0], [1.0, 0.0], [0.0, 2.5]]])  # totals [3, 2.5]: class 0


@pytest.mark.parametrize(
    ("order", "removed", "flipped"),
    [
        ([0.9, 0.1, 0.5], 1, True),  # without item 0: [1, 2.5]
        ([0.1, 0.9, 0.5], 1, True),  # without item 1: [2, 2.5]
        ([0.1, 0.2, 0.9], 3, False),  # item 2, then item 1: still class 0; stop at one left
        ([0.1, 0.1, 0.9], 3, False),  # tie: item 0 before item 1 -> [0, 0] after two: argmax 0
    ],
)
def test_erasure_by_hand(order, removed, flipped):
    result = erasure(votes, X, None, torch.tensor([order]))
    assert result.removed.tolist() == [removed]
    assert result.flipped.tolist() == [flipped]
    assert result.fraction.tolist() == [removed / 3]


def test_erasure_counts_only_kept_items():
    x = torch.cat([X, torch.tensor([[[0.0, 9.0]]])], dim=1)  # a padded item that would decide
    keep = torch.tensor([[True, True, True, False]])
    result = erasure(votes, x, keep, torch.tensor([[0.1, 0.2, 0.9, 1.0]]))
    assert result.removed.tolist() == [3] and result.fraction.tolist() == [1.0]


def test_erasure_on_an_attention_model_matches_dropping_items():
    model = pooled(seed=4)
    x = torch.randn(4, 6, 4, dtype=torch.float64)
    order = random_order(torch.ones(4, 6, dtype=torch.bool), seed=1)
    result = erasure(model, x, None, order)
    for b in range(4):
        ranking = order[b].argsort(descending=True)
        decision = int(model(x[b : b + 1], torch.ones(1, 6, dtype=torch.bool)).argmax())
        expected = 6
        for k in range(1, 6):
            rest = x[b : b + 1, ranking[k:].sort().values]
            if int(model(rest, torch.ones(1, 6 - k, dtype=torch.bool)).argmax()) != decision:
                expected = k
                break
        assert int(result.removed[b]) == expected


def test_erasure_errors():
    with pytest.raises(ValueError, match="order"):
        erasure(votes, X, None, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="logits"):
        erasure(lambda x, keep: x.sum((1, 2)), X, None, torch.zeros(1, 3))
