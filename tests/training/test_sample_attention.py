"""Attention over training samples: weights per class on the simplex of that class's samples,
prototypes as weighted means, the bounded loss against its formula, and mislabelled samples
planted in a training set end with low weight."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.evaluation import capture
from attnkit.training.sample_attention import SampleAttention


def test_weights_prototypes_and_sample_weights():
    torch.manual_seed(0)
    attention = SampleAttention(3, 4, key_dim=5)
    torch.nn.init.normal_(attention.queries)
    torch.nn.init.normal_(attention.key.weight)
    x = torch.randn(7, 3)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 2])  # class 3 has no sample
    with capture(attention) as records:
        out = attention(x, labels)
    assert out.weights.shape == (4, 7) and out.prototypes.shape == (4, 3)
    weights, sample_weights = out.weights.detach(), out.sample_weights.detach()
    for c in range(4):
        members = (labels == c).nonzero().flatten().tolist()
        keys = (x @ attention.key.weight.T).detach()
        query = attention.queries[c].detach()
        scores = [-float((query - keys[s]).norm()) for s in members]
        expected = torch.tensor(scores).softmax(0) if members else torch.zeros(0)
        torch.testing.assert_close(weights[c, members], expected)
        outside = [s for s in range(7) if s not in members]
        assert weights[c, outside].abs().sum() == 0
        proto = sum((float(weights[c, s]) * x[s] for s in members), torch.zeros(3))
        torch.testing.assert_close(out.prototypes[c].detach(), proto)
        for s in members:
            assert float(sample_weights[s]) == pytest.approx(
                float(weights[c, s]) * len(members), rel=1e-5
            )
    assert set(records) == {"attention"}  # the weights go through the core's capture hook


def test_bounded_loss_against_its_formula():
    torch.manual_seed(0)
    attention = SampleAttention(2, 2)
    x, labels = torch.randn(5, 2), torch.tensor([0, 0, 1, 1, 1])
    p = attention(x, labels).prototypes.detach()
    expected = sum(
        1 - math.exp(-float((x[s] - p[labels[s]]).pow(2).sum()) / (2 * 1.5**2)) for s in range(5)
    )
    loss = attention.prototype_loss(x, labels, scale=1.5)
    assert float(loss.detach()) == pytest.approx(expected / 5, rel=1e-5)


@pytest.mark.parametrize(
    ("x", "labels", "error", "match"),
    [
        (torch.randn(4, 3), torch.zeros(4, dtype=torch.long), ValueError, r"x must be \(S, 2\)"),
        (torch.randn(4, 2), torch.zeros(4), TypeError, "labels must be an integer tensor"),
        (torch.randn(4, 2), torch.zeros(3, dtype=torch.long), ValueError, r"labels must be \(4,\)"),
        (torch.randn(4, 2), torch.full((4,), 3), ValueError, r"labels must lie in \[0, 3\)"),
    ],
)
def test_errors(x, labels, error, match):
    with pytest.raises(error, match=match):
        SampleAttention(2, 3)(x, labels)


def test_mislabelled_samples_get_low_weight():
    g = torch.Generator().manual_seed(0)
    classes, per, d, noisy_count = 3, 40, 4, 12
    centres = torch.randn(classes, d, generator=g) * 5
    truth = torch.arange(classes).repeat_interleave(per)
    x = centres[truth] + torch.randn(len(truth), d, generator=g)
    flipped = torch.randperm(len(truth), generator=g)[:noisy_count]
    labels = truth.clone()
    labels[flipped] = (truth[flipped] + torch.randint(1, classes, (noisy_count,), generator=g)) % 3
    noisy = labels != truth
    assert int(noisy.sum()) == noisy_count
    with torch.random.fork_rng():
        torch.manual_seed(0)
        attention = SampleAttention(d, classes)
    # at the start every sample weighs about as much as any other (the plain class mean)
    start = attention(x, labels).sample_weights.detach()
    assert float((start - 1).abs().max()) < 0.3
    optimiser = torch.optim.Adam(attention.parameters(), lr=0.03)
    for _ in range(120):
        loss = attention.prototype_loss(x, labels, scale=2.0)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    weights = attention(x, labels).sample_weights.detach()
    assert float(weights[noisy].mean()) < 0.25 * float(weights[~noisy].mean())
    # ranking by weight separates the planted samples (AUROC)
    auroc = (weights[~noisy][:, None] > weights[noisy][None]).float().mean()
    assert float(auroc) > 0.95


def test_describe_reads_a_learned_query_per_class():
    row = ak.describe(SampleAttention(3, 2))
    assert (row.query_type, row.query_multiplicity, row.scoring) == (
        "Self-Attentive",
        "Capsule-Based",
        "Similarity",
    )
