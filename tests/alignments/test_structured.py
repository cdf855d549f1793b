"""Structured attention (Kim et al.): CRF marginals against brute-force enumeration."""

import itertools

import pytest
import torch
from alignments.rows import per_row
from helpers import assert_same_forward_backward, rand

from attnkit import alignments as al
from attnkit.alignments.structured import chain_marginals


def brute_row(e, allowed, w):
    """p(z_l = 1) by summing exp(Σ θ_l(z_l) + Σ W[z_l, z_next]) over all 2^S assignments of
    the S allowed keys (consecutive allowed keys are neighbours); masked keys get 0."""
    keys = [j for j in range(len(e)) if allowed[j]]
    if not keys:
        return torch.zeros_like(e)
    total = e.new_zeros(())
    selected = [e.new_zeros(()) for _ in keys]
    for z in itertools.product([0, 1], repeat=len(keys)):
        s = sum(e[j] for j, zj in zip(keys, z, strict=True) if zj) + e.new_zeros(())
        s = s + sum(w[z[i], z[i + 1]] for i in range(len(keys) - 1))
        p = torch.exp(s)
        total = total + p
        for i, zi in enumerate(z):
            if zi:
                selected[i] = selected[i] + p
    out = [e.new_zeros(()) for _ in range(len(e))]
    for i, j in enumerate(keys):
        out[j] = selected[i] / total
    return torch.stack(out)


W = torch.tensor([[0.7, -0.4], [-0.9, 1.3]], dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_marginals_equal_enumeration(n):
    e = rand(2, 3, n)
    w = W.clone().requires_grad_()
    assert_same_forward_backward(
        lambda: chain_marginals(e, w),
        lambda: per_row(lambda r, a, m: brute_row(r, a, w), e),
        [e, w],
        atol=1e-12,
        rtol=1e-10,
    )


def test_masked_keys_leave_the_chain():
    e = rand(2, 3, 6, seed=1)
    mask = torch.tensor([[True, False, True, True, False, True], [False] * 3 + [True] * 3])
    mask = mask[:, None].expand(2, 3, 6).clone()
    mask[1, 2] = False  # a fully masked row
    e.data[~mask] = float("nan")  # what sits at a masked key never matters
    align = al.Structured(W, learnable=True, dtype=torch.float64)
    out = align(e, mask).weights
    assert (out[~mask] == 0).all() and (out[1, 2] == 0).all()
    assert_same_forward_backward(
        lambda: align(e, mask).weights,
        lambda: per_row(lambda r, a, m: brute_row(r, a, align.pairwise), e, mask),
        [e, align.pairwise],
        atol=1e-12,
        rtol=1e-10,
    )


def test_independent_keys_give_the_sigmoid():
    e = rand(2, 4, 7, seed=2)
    out = al.Structured(dtype=torch.float64)(e).weights  # W starts at 0
    torch.testing.assert_close(out, torch.sigmoid(e), atol=1e-13, rtol=0)


def test_normalized_marginals_sum_to_one():
    e = rand(2, 3, 5, seed=3)
    mask = torch.tensor([True, True, False, True, True])
    align = al.Structured(W, normalize=True)
    assert align.normalized and not al.Structured(W).normalized
    out = align(e, mask).weights
    marg = per_row(lambda r, a, m: brute_row(r, a, W), e, mask[None, None])
    torch.testing.assert_close(out, marg / marg.sum(-1, keepdim=True), atol=1e-12, rtol=1e-10)
    # Far below 0 every marginal underflows; the normalised weights stay on the simplex.
    low = align(e.detach() - 1e5, mask).weights
    torch.testing.assert_close(low.sum(-1), torch.ones(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("normalize", [False, True])
def test_gradcheck(normalize):
    e = rand(1, 2, 4, seed=4)
    align = al.Structured(W, learnable=True, normalize=normalize, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]])
    assert torch.autograd.gradcheck(
        lambda e, w: chain_marginals(e, w, mask) if not normalize else align(e, mask).weights,
        (e, align.pairwise),
    )


def test_a_given_pairwise_is_fixed_unless_learnable():
    assert list(al.Structured(W).parameters()) == []
    assert len(list(al.Structured(W, learnable=True).parameters())) == 1
    assert len(list(al.Structured().parameters())) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="shape"):
        al.Structured(torch.zeros(3, 3))
    with pytest.raises(TypeError, match="pairwise"):
        al.Structured([[0.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="learnable=False"):
        al.Structured(learnable=False)
    with pytest.raises(ValueError, match="finite"):
        al.Structured(torch.tensor([[0.0, float("inf")], [0.0, 0.0]]))
