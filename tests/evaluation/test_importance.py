"""Importance measures against closed forms (linear and quadratic models), integrated gradients'
completeness, and leave-one-out against removing the item from the input altogether."""

import pytest
import torch
from toy_models import pooled

from attnkit.evaluation import importance as imp


def linear(w):
    return lambda x, keep: (x * w).sum((-2, -1))


def test_gradient_of_a_linear_model_is_the_norm_of_its_weights():
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    got = imp.gradient(linear(w), x)
    torch.testing.assert_close(got, w.norm(dim=-1).expand(2, 5))


def test_input_x_gradient_and_integrated_gradients_of_a_linear_model():
    torch.manual_seed(1)
    w = torch.randn(4, 3, dtype=torch.float64)
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    expected = (w * x).sum(-1)  # by hand: ∂f/∂x = w
    torch.testing.assert_close(imp.input_x_gradient(linear(w), x), expected)
    torch.testing.assert_close(imp.integrated_gradients(linear(w), x, steps=2), expected)
    base = torch.ones_like(x)
    torch.testing.assert_close(
        imp.integrated_gradients(linear(w), x, baseline=base, steps=2), (w * (x - 1)).sum(-1)
    )


def test_integrated_gradients_of_a_quadratic_is_exact():
    x = torch.tensor([[[1.0, 2.0], [-3.0, 0.5], [0.0, 4.0]]], dtype=torch.float64)
    got = imp.integrated_gradients(lambda x, keep: (x**2).sum((-2, -1)), x, steps=3)
    torch.testing.assert_close(got, torch.tensor([[5.0, 9.25, 16.0]], dtype=torch.float64))


def test_integrated_gradients_completeness_on_an_attention_model():
    model = pooled(seed=2)
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[2, 4:] = False

    def f(x, keep):
        return model(x, keep)[:, 1]

    ig = imp.integrated_gradients(f, x, keep, steps=64)
    with torch.no_grad():
        gap = f(x, keep) - f(torch.zeros_like(x), keep)
    torch.testing.assert_close(ig.sum(-1), gap, atol=1e-4, rtol=0)
    coarse = imp.integrated_gradients(f, x, keep, steps=1)
    assert (coarse.sum(-1) - gap).abs().max() > 1e-3  # the check above can fail
    assert bool((ig[2, 4:] == 0).all())


def test_leave_one_out_equals_removing_the_item():
    model = pooled(seed=3)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 4] = False

    def f(x, keep):
        return model(x, keep).log_softmax(-1)[:, 0]

    got = imp.leave_one_out(f, x, keep)
    for b in range(2):
        n = int(keep[b].sum())
        xb = x[b : b + 1, :n]
        full = f(xb, torch.ones(1, n, dtype=torch.bool))
        for i in range(n):
            rest = torch.cat([xb[:, :i], xb[:, i + 1 :]], dim=1)
            without = f(rest, torch.ones(1, n - 1, dtype=torch.bool))
            torch.testing.assert_close(got[b, i], (full - without)[0].detach())
    assert got[1, 4] == 0


def test_leave_one_out_hand_example():
    c = torch.tensor([[1.0, -2.0, 0.5]])
    got = imp.leave_one_out(lambda x, keep: (keep * c).sum(-1), torch.zeros(1, 3, 2))
    torch.testing.assert_close(got, c)


def test_gradient_is_zero_at_items_not_kept_and_at_unused_inputs():
    x = torch.randn(1, 3, 2)
    keep = torch.tensor([[True, False, True]])
    got = imp.gradient(lambda x, keep: (x * keep.unsqueeze(-1)).sum((-2, -1)), x, keep)
    torch.testing.assert_close(got, torch.tensor([[2**0.5, 0.0, 2**0.5]]))
    got = imp.gradient(lambda x, keep: torch.ones(1, requires_grad=True), x)
    assert bool((got == 0).all())


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.zeros(2, 3),), ValueError, "inputs must be"),
        ((torch.zeros(1, 2, 3, dtype=torch.long),), TypeError, "floating"),
        ((torch.zeros(1, 2, 3), torch.ones(1, 2)), TypeError, "keep"),
        ((torch.zeros(1, 2, 3), torch.ones(1, 3, dtype=torch.bool)), ValueError, "keep"),
    ],
)
def test_bad_inputs_are_named(args, error, match):
    with pytest.raises(error, match=match):
        imp.gradient(lambda x, keep: x.sum((-2, -1)), *args)


def test_f_must_give_one_scalar_per_example_and_steps_must_be_positive():
    x = torch.zeros(2, 3, 1)
    with pytest.raises(ValueError, match="one scalar per example"):
        imp.leave_one_out(lambda x, keep: x.sum(), x)
    with pytest.raises(ValueError, match="steps"):
        imp.integrated_gradients(lambda x, keep: x.sum((-2, -1)), x, steps=0)
