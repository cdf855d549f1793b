"""Counterfactual attention: permuted, uniform and adversarial weights, checked against the
outputs recomputed by hand from the model's parts."""

import math

import pytest
import torch
from scipy.spatial.distance import jensenshannon
from toy_models import pooled

import attnkit as ak
from attnkit.evaluation import capture
from attnkit.evaluation import counterfactual as cf


def by_hand(model, x, weights):
    """The Pooled model's logits for given weights (B, N): context = Σ a_l tanh(W v_l + b)."""
    values = torch.tanh(model.value(x))
    return model.out((weights.unsqueeze(-1) * values).sum(1))


def test_divergences_against_scipy_and_by_hand():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(5, 7, generator=g, dtype=torch.float64)
    q = torch.rand(5, 7, generator=g, dtype=torch.float64)
    p[0, :3] = 0  # zeros on one side
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    ref = torch.tensor(
        [jensenshannon(a, b) ** 2 for a, b in zip(p.numpy(), q.numpy(), strict=True)]
    )
    torch.testing.assert_close(cf.jensen_shannon(p, q), ref.double())
    one_hot = torch.eye(2, dtype=torch.float64)
    assert float(cf.jensen_shannon(one_hot[0], one_hot[1])) == pytest.approx(math.log(2))
    tvd = cf.total_variation(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.3, 0.5]))
    assert float(tvd) == pytest.approx(0.5)


def test_permute_rows_shuffles_only_attendable_keys():
    w = torch.tensor([[[0.1, 0.2, 0.0, 0.7]]]).expand(64, 1, 4)
    mask = torch.tensor([True, True, False, True]).expand(64, 1, 4)
    out = cf.permute_rows(w, mask, torch.Generator().manual_seed(0))
    assert bool((out[..., 2] == 0).all())
    torch.testing.assert_close(out.sort(-1).values, w.sort(-1).values)
    assert len({tuple(r.tolist()) for r in out[:, 0]}) == 6  # all 3! orders appear


def test_permuted_weights_with_two_keys_is_the_swap_or_nothing():
    model = pooled(seed=1)
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    keep = torch.ones(3, 2, dtype=torch.bool)
    with capture(model) as records:
        learned = model(x, keep).softmax(-1)
    w = records["attention"][0][:, 0]
    swapped = by_hand(model, x, w.flip(-1)).softmax(-1)
    ref = 0.5 * (learned - swapped).abs().sum(-1).detach()
    result = cf.permuted_weights(model, lambda: model(x, keep), n_permutations=40)
    assert result.output_change.shape == (3, 40)
    for b in range(3):
        values = result.output_change[b]
        is_zero = values.abs() < 1e-12
        assert bool(is_zero.any()) and bool((~is_zero).any())
        torch.testing.assert_close(values[~is_zero], ref[b].expand(int((~is_zero).sum())))
    assert isinstance(model.attention.align, ak.alignments.Softmax)  # restored


def test_uniform_baseline_by_hand():
    model = pooled(seed=2)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 3:] = False
    learned = model(x, keep).softmax(-1)
    uniform = keep.double() / keep.sum(-1, keepdim=True)
    ref = 0.5 * (learned - by_hand(model, x, uniform).softmax(-1)).abs().sum(-1)
    torch.testing.assert_close(cf.uniform_baseline(model, lambda: model(x, keep)), ref.detach())


def test_adversarial_weights_stay_within_epsilon_and_diverge():
    model = pooled(seed=3)
    x = torch.randn(6, 7, 4, dtype=torch.float64)
    keep = torch.ones(6, 7, dtype=torch.bool)
    keep[0, 5:] = False
    before = [p.detach().clone() for p in model.parameters()]
    eps = 0.02
    result = cf.adversarial_weights(model, lambda: model(x, keep), epsilon=eps, steps=60)
    # recomputed independently: the output with the adversarial weights, by hand
    learned = model(x, keep).softmax(-1)
    adv = by_hand(model, x, result.weights[:, 0]).softmax(-1)
    change = 0.5 * (learned - adv).abs().sum(-1)
    assert bool((change < eps).all())
    torch.testing.assert_close(change.detach(), result.output_change)
    torch.testing.assert_close(
        cf.jensen_shannon(result.weights, result.learned)[:, 0], result.divergence
    )
    assert float(result.divergence.max()) > 0.05
    assert bool((result.weights[0, 0, 5:] == 0).all())  # padding stays unattended
    torch.testing.assert_close(result.weights.sum(-1), torch.ones(6, 1, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_edit_weights_reaches_multihead_attention_and_is_restored():
    mha = ak.MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    with cf.edit_weights(mha, lambda w, m: torch.full_like(w, 1 / 3)), capture(mha) as records:
        mha(x)
    torch.testing.assert_close(records["attention"][0], torch.full((1, 2, 3, 3), 1 / 3).double())
    assert isinstance(mha.attention.align, ak.alignments.Softmax)


def test_errors():
    model = pooled()
    x = torch.randn(1, 3, 4, dtype=torch.float64)
    keep = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="only='nope'"), cf.edit_weights(model, None, only="nope"):
        pass
    with (
        pytest.raises(ValueError, match="no alignment part"),
        cf.edit_weights(torch.nn.Linear(2, 2), None),
    ):
        pass
    with pytest.raises(ValueError, match="2 alignment calls"):
        cf.adversarial_weights(model, lambda: model(x, keep) + model(x, keep), steps=1)
    with pytest.raises(ValueError, match="epsilon"):
        cf.adversarial_weights(model, lambda: model(x, keep), epsilon=0)
    with pytest.raises(ValueError, match=r"logits \(B, C\)"):
        cf.uniform_baseline(model, lambda: model(x, keep)[:, 0])
    with pytest.raises(ValueError, match="n_permutations"):
        cf.permuted_weights(model, lambda: model(x, keep), n_permutations=0)


def _p(*shape):
    return torch.rand(*shape).softmax(-1)


BAD_CALLS = [
    (
        "jsd: shapes differ",
        lambda: cf.jensen_shannon(_p(2, 5), _p(2, 4)),
        ValueError,
        r"q has shape \(2, 4\) but p has \(2, 5\)",
    ),
    (
        "jsd: negative p",
        lambda: cf.jensen_shannon(torch.tensor([-1.0, 2.0]), torch.tensor([0.5, 0.5])),
        ValueError,
        r"p must be non-negative \(probabilities\), got -1.0 at index \(0,\)",
    ),
    (
        "jsd: unnormalised q",
        lambda: cf.jensen_shannon(_p(2, 3), torch.ones(2, 3)),
        ValueError,
        r"q must hold probability distributions.*row \(0,\) sums to 3",
    ),
    (
        "jsd: integer p",
        lambda: cf.jensen_shannon(torch.ones(3, dtype=torch.long), _p(3)),
        TypeError,
        r"p must be a floating-point tensor \(…, N\), got dtype torch.int64",
    ),
    (
        "jsd: not a tensor",
        lambda: cf.jensen_shannon([0.5, 0.5], _p(2)),
        TypeError,
        r"p must be a torch.Tensor",
    ),
    (
        "tvd: shapes differ",
        lambda: cf.total_variation(_p(2, 5), _p(2, 4)),
        ValueError,
        r"q has shape \(2, 4\) but p has \(2, 5\)",
    ),
    (
        "tvd: broadcast refused",
        lambda: cf.total_variation(_p(1, 5), _p(3, 5)),
        ValueError,
        r"q has shape \(3, 5\) but p has \(1, 5\)",
    ),
    (
        "tvd: negative q",
        lambda: cf.total_variation(_p(4), torch.tensor([1.5, -0.5, 0.0, 0.0])),
        ValueError,
        r"q must be non-negative",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_divergences_accept_empty_rows_and_half_precision():
    # A query with no key allowed has weights 0 (masked softmax): an empty row, not an error.
    p = torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    assert cf.total_variation(p, q).tolist() == pytest.approx([0.0, 0.5])
    assert float(cf.jensen_shannon(p, q)[0]) == 0.0
    # bfloat16 softmax rows miss 1 by more than float32 ones; they are still distributions.
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    low = x.to(torch.bfloat16).softmax(-1)
    d = cf.jensen_shannon(low, low.flip(-1))
    assert bool((d >= 0).all()) and bool((d.double() <= math.log(2) + 1e-2).all())
