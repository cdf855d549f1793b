"""LISA's head supervision: the loss against a loop, its gradient confined to what the head
depends on, and a trained stack whose supervised head finds the planted parents while the
other heads do not."""

import math

import pytest
import torch
from parent_tagger import HEADS, accuracy, parent_class

from attnkit.training.graph_capture import stack_head_weights
from attnkit.training.head_supervision import (
    head_supervision_loss,
    parent_accuracy,
    parent_loss,
)
from attnkit.transformer import TransformerEncoder


def test_parent_loss_is_the_mean_negative_log_weight_of_the_parent():
    torch.manual_seed(0)
    w = torch.randn(2, 4, 5, dtype=torch.float64).softmax(-1)
    parents = torch.tensor([[-1, 0, 3, 1], [2, -1, 4, 4]])
    terms = [
        -math.log(float(w[b, i, parents[b, i]]))
        for b in range(2)
        for i in range(4)
        if parents[b, i] >= 0
    ]
    assert float(parent_loss(w, parents)) == pytest.approx(sum(terms) / len(terms))
    hits = [
        int(w[b, i].argmax()) == int(parents[b, i])
        for b in range(2)
        for i in range(4)
        if parents[b, i] >= 0
    ]
    assert parent_accuracy(w, parents) == pytest.approx(sum(hits) / len(hits))


def test_loss_on_one_head_trains_only_what_that_head_depends_on():
    torch.manual_seed(0)
    enc = TransformerEncoder(2, 8, 2, 16)
    x = torch.randn(2, 4, 8)
    parents = torch.tensor([[-1, 0, 1, 1], [-1, 0, 0, 2]])
    out, loss = head_supervision_loss(enc, x, parents, layer=0, head=1)
    torch.testing.assert_close(out, enc(x), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.layers[0].parameters())
    assert all(p.grad is None for p in enc.layers[1].parameters())


@pytest.mark.parametrize(
    ("parents", "error", "match"),
    [
        (torch.zeros(2, 3), TypeError, "parents must be an integer tensor"),
        (torch.zeros(2, 4, dtype=torch.long), ValueError, r"shape \(2, 3\)"),
        (torch.full((2, 3), 5), ValueError, r"key indices in \[0, 5\) or −1 \(no parent\), got 5"),
        (torch.full((2, 3), -2), ValueError, "got -2"),
    ],
)
def test_parent_errors(parents, error, match):
    with pytest.raises(error, match=match):
        parent_loss(torch.rand(2, 3, 5).softmax(-1), parents)


def test_supervised_head_finds_the_parents_and_the_others_do_not(lisa_tagger):
    model, test = lisa_tagger.model, lisa_tagger.test
    with torch.no_grad():
        _, weights = stack_head_weights(model.encoder, model.inputs(test.tokens), layer=0)
        tags = model(test.tokens)
    shares = [parent_accuracy(weights[:, h], test.parents) for h in range(HEADS)]
    assert shares[0] > 0.9, shares
    assert max(shares[1:]) < 0.5, shares
    assert accuracy(tags, parent_class(test)) > 0.9
