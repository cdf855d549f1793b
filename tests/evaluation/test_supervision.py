"""Supervised attention loss."""

import pytest
import torch

from attnkit.evaluation import supervised_attention_loss


def test_kl_and_mse():
    w = torch.tensor([[0.5, 0.25, 0.25]])
    gold = torch.tensor([[True, True, False]])  # -> [0.5, 0.5, 0]
    kl = 0.5 * (torch.log(torch.tensor(0.5)) - torch.log(torch.tensor(0.5))) + 0.5 * (
        torch.log(torch.tensor(0.5)) - torch.log(torch.tensor(0.25))
    )
    assert float(supervised_attention_loss(w, gold)) == pytest.approx(float(kl))
    mse = ((0.0) ** 2 + 0.25**2 + 0.25**2) / 3
    assert float(supervised_attention_loss(w, gold, kind="mse")) == pytest.approx(mse)


def test_rows_without_gold_do_not_count_and_gradient_flows():
    w = torch.tensor([[0.5, 0.5], [0.9, 0.1]], requires_grad=True)
    gold = torch.tensor([[True, False], [False, False]])
    loss = supervised_attention_loss(w, gold)
    assert float(loss.detach()) == pytest.approx(float(torch.log(torch.tensor(2.0))))
    loss.backward()
    assert w.grad[1].abs().sum() == 0 and w.grad[0, 0] < 0
    with pytest.raises(ValueError, match="kind"):
        supervised_attention_loss(w, gold, kind="l1")
