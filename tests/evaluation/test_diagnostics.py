"""Wiegreffe & Pinter's diagnostics: seed variance by hand, the pooled MLP against a loop, the
frozen-weights probe telling right weights from uniform ones, and the trained adversary."""

import math

import pytest
import torch
from toy_models import pooled

from attnkit.evaluation import capture
from attnkit.evaluation.diagnostics import (
    PooledMLP,
    frozen_weights_probe,
    seed_variance,
    train_adversary,
    uniform_pooling,
)
from attnkit.evaluation.suite import Probe


def _jsd(p: list[float], q: list[float]) -> float:
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0)  # noqa: E731
    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def test_seed_variance_by_hand():
    base_w = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    other_w = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    base_p = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)
    other_p = torch.tensor([[0.6, 0.4], [0.2, 0.8]], dtype=torch.float64)
    got = seed_variance([base_w, other_w, base_w], [base_p, other_p, base_p])
    assert got.divergence.shape == got.output_change.shape == (2, 2)
    # identical distributions: 0; disjoint ones: ln 2
    assert got.divergence[0].tolist() == pytest.approx([0.0, math.log(2)])
    assert got.divergence[1].tolist() == [0.0, 0.0]
    assert got.output_change[0].tolist() == pytest.approx([0.3, 0.0])
    w1, w2 = [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]
    got = seed_variance([torch.tensor([w1]), torch.tensor([w2])], [base_p[:1], base_p[:1]])
    assert float(got.divergence[0, 0]) == pytest.approx(_jsd(w2, w1))
    with pytest.raises(ValueError, match="two seeds"):
        seed_variance([base_w], [base_p])
    with pytest.raises(ValueError, match="every seed"):
        seed_variance([base_w, base_w[:1]], [base_p, base_p[:1]])


def test_pooled_mlp_equals_a_loop():
    torch.manual_seed(0)
    mlp = PooledMLP(3, 5, 2).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    w = torch.rand(2, 4, dtype=torch.float64)
    got = mlp(x, keep, w)
    for b in range(2):
        pooled_h = sum(
            w[b, t] * torch.relu(mlp.item.weight @ x[b, t] + mlp.item.bias)
            for t in range(4)
            if keep[b, t]
        )
        torch.testing.assert_close(got[b], mlp.out.weight @ pooled_h + mlp.out.bias)
    learned = PooledMLP(3, 5, 2, learned=True).double()
    h = torch.relu(learned.item(x[1]))
    alpha = torch.softmax(torch.tanh(h) @ learned.score.weight[0], 0)
    expected = learned.out(alpha @ h)
    torch.testing.assert_close(learned(x, keep)[1], expected)
    with pytest.raises(ValueError, match="needs weights"):
        mlp(x, keep)
    with pytest.raises(ValueError, match="computes its own"):
        learned(x, keep, w)


def test_uniform_pooling():
    keep = torch.tensor([[True, False, True], [False, False, False]])
    assert uniform_pooling(keep).tolist() == [[0.5, 0.0, 0.5], [0.0, 0.0, 0.0]]


def test_frozen_right_weights_beat_uniform_and_learned_pooling():
    """Every item carries a sign ±3; the label is the sign of one item that nothing about the
    item itself marks (its position is random). Frozen gold weights let the item-wise MLP read
    it; uniform pooling and the MLP's own attention, which sees one item at a time, cannot
    single it out (the majority of ten signs agrees with it only about 62 % of the time)."""
    g = torch.Generator().manual_seed(0)
    b, n, d = 600, 10, 4
    x = torch.randn(b, n, d, generator=g)
    x[..., 0] = torch.where(torch.rand(b, n, generator=g) < 0.5, 3.0, -3.0)
    where = torch.randint(0, n, (b,), generator=g)
    labels = (x[torch.arange(b), where, 0] > 0).long()
    keep = torch.ones(b, n, dtype=torch.bool)
    gold = torch.zeros(b, n)
    gold[torch.arange(b), where] = 1.0
    train = torch.arange(b) < 400
    acc = frozen_weights_probe(
        x,
        keep,
        labels,
        {"gold": gold, "uniform": uniform_pooling(keep), "learned": "learned"},
        train=train,
        steps=200,
    )
    assert acc["gold"] > 0.95
    assert acc["uniform"] < 0.8 and acc["learned"] < 0.8
    with pytest.raises(ValueError, match="held out"):
        frozen_weights_probe(x, keep, labels, {"u": gold}, train=torch.ones(b, dtype=torch.bool))
    with pytest.raises(ValueError, match="'learned'"):
        frozen_weights_probe(x, keep, labels, {"u": "lerned"}, train=train)


def _probe(model, x, keep):
    with torch.no_grad(), capture(model) as records:
        model(x, keep)
    return Probe(
        model=model, logits=model, inputs=x, keep=keep, attention=records["attention"][0][:, 0]
    )


def test_the_adversary_moves_attention_keeps_predictions_and_restores_the_model():
    model = pooled(seed=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, 4, generator=g, dtype=torch.float64)
    keep = torch.ones(40, 6, dtype=torch.bool)
    keep[:5, 4:] = False
    probe = _probe(model, x, keep)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train = torch.arange(40) < 30
    still = train_adversary(probe, train=train, lam=1.0, steps=0)
    assert float(still.divergence.abs().max()) < 1e-12 and still.agreement == 1.0
    result = train_adversary(probe, train=train, lam=1.0, steps=150, lr=1e-2)
    assert result.weights.shape == (40, 1, 6)
    assert float(result.divergence[train].mean()) > 0.1  # the attention moved
    assert float(result.output_change[train].mean()) < 0.1  # the predictions hardly did
    assert bool((result.weights[:5, 0, 4:] == 0).all())  # masks still hold
    without_penalty = train_adversary(probe, train=train, lam=0.0, steps=150, lr=1e-2)
    assert float(without_penalty.divergence.mean()) < float(result.divergence.mean())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="lam"):
        train_adversary(probe, train=train, lam=-1.0)


BAD_CALLS = [
    (
        "negative weights",
        lambda: seed_variance(
            [torch.tensor([[1.5, -0.5]]), torch.tensor([[0.5, 0.5]])],
            [torch.tensor([[1.0, 0.0]])] * 2,
        ),
        ValueError,
        r"weights\[0\] must be non-negative \(probabilities\), got -0.5",
    ),
    (
        "unnormalised probabilities",
        lambda: seed_variance([torch.tensor([[0.5, 0.5]])] * 2, [torch.tensor([[0.9, 0.9]])] * 2),
        ValueError,
        r"probabilities\[0\] must hold probability distributions.*sums to 1.8",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
