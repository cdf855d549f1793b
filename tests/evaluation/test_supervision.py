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


def _w(*shape):
    return torch.rand(*shape).softmax(-1)


BAD_CALLS = [
    (
        "gold of another width",
        lambda: supervised_attention_loss(_w(2, 3, 5), torch.ones(2, 3, 4, dtype=torch.bool)),
        ValueError,
        r"gold has shape \(2, 3, 4\) but weights has \(2, 3, 5\)",
    ),
    (
        "negative gold scores",
        lambda: supervised_attention_loss(_w(1, 1, 2), torch.tensor([[[-1.0, 2.0]]])),
        ValueError,
        r"gold must be non-negative \(scores\), got -1.0",
    ),
    (
        "integer gold",
        lambda: supervised_attention_loss(_w(1, 1, 2), torch.ones(1, 1, 2, dtype=torch.long)),
        TypeError,
        r"gold must be boolean links or floating.*torch.int64",
    ),
    (
        "float rows",
        lambda: supervised_attention_loss(_w(2, 3, 5), _w(2, 3, 5), rows=torch.ones(2, 3)),
        TypeError,
        r"rows must be boolean",
    ),
    (
        "rows of another shape",
        lambda: supervised_attention_loss(
            _w(2, 3, 5), _w(2, 3, 5), rows=torch.ones(2, 4, dtype=torch.bool)
        ),
        ValueError,
        r"rows of shape \(2, 4\) does not broadcast to \(2, 3\)",
    ),
    (
        "integer weights",
        lambda: supervised_attention_loss(torch.ones(2, 3, dtype=torch.long), _w(2, 3)),
        TypeError,
        r"weights must be a floating-point",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
