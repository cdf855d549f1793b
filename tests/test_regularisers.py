"""Multi-head disagreement (Li et al. 2018) against loops over head pairs, and head_parts
against the module's own forward pass."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rand

import attnkit as ak
from attnkit import regularisers as rg


def cos_loop(x, mask):
    """−1/H² Σ_i Σ_j cos(x^i, x^j), the cosine of each position averaged over real ones."""
    b, h, length, _ = x.shape
    out = []
    for item in range(b):
        keep = [p for p in range(length) if mask is None or bool(mask[item, p])]
        total = x.new_zeros(())
        for i in range(h):
            for j in range(h):
                for p in keep:
                    u, v = x[item, i, p], x[item, j, p]
                    total = total + (u @ v) / (u.norm() * v.norm())
        out.append(-total / max(len(keep), 1) / h**2)
    return torch.stack(out)


def position_loop(a, mask):
    """−1/H² Σ_i Σ_j Σ_{m,n} |A^i_mn A^j_mn|, averaged over real query rows."""
    b, h, m, n = a.shape
    out = []
    for item in range(b):
        rows = [r for r in range(m) if mask is None or bool(mask[item, r])]
        total = a.new_zeros(())
        for i in range(h):
            for j in range(h):
                for r in rows:
                    for c in range(n):
                        total = total + (a[item, i, r, c] * a[item, j, r, c]).abs()
        out.append(-total / max(len(rows), 1) / h**2)
    return torch.stack(out)


MASK = torch.tensor([[True] * 5, [True, True, True, False, False]])


@pytest.mark.parametrize("fn", [rg.subspace_disagreement, rg.output_disagreement])
@pytest.mark.parametrize("mask", [None, MASK, MASK[:, None]])
def test_cosine_terms_equal_the_loop(fn, mask):
    x = rand(2, 3, 5, 4)
    flat = None if mask is None else mask.reshape(2, 5)
    torch.testing.assert_close(fn(x, mask), cos_loop(x, flat))
    g1 = torch.autograd.grad(fn(x, mask).sum(), x)[0]
    g2 = torch.autograd.grad(cos_loop(x, flat).sum(), x)[0]
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("mask", [None, MASK])
def test_position_term_equals_the_loop(mask):
    a = torch.softmax(rand(2, 3, 5, 6, seed=1), -1)
    torch.testing.assert_close(rg.position_disagreement(a, mask), position_loop(a, mask))


@pytest.mark.parametrize("fn", [rg.subspace_disagreement, rg.output_disagreement])
def test_cosine_terms_at_their_extremes(fn):
    one = rand(2, 1, 5, 4, seed=2, grad=False)
    same = one.expand(2, 4, 5, 4)
    torch.testing.assert_close(fn(same), torch.full((2,), -1.0, dtype=torch.float64))
    opposite = torch.cat([one, -one], dim=1)  # cos = 1 + 1 − 1 − 1 = 0
    assert (fn(opposite).abs() <= 1e-15).all()
    scaled = torch.cat([one, 3 * one], dim=1)  # cosine ignores the length
    torch.testing.assert_close(fn(scaled), torch.full((2,), -1.0, dtype=torch.float64))


def test_position_term_at_its_extremes():
    one_hot = F.one_hot(torch.tensor([[2, 0, 4], [1, 1, 3]]), 5).double()  # (B=2, M=3, N=5)
    same = one_hot[:, None].expand(2, 4, 3, 5)
    torch.testing.assert_close(
        rg.position_disagreement(same), torch.full((2,), -1.0, dtype=torch.float64)
    )
    # head h attends key h in every row: (B, M, H, N) -> (B, H, M, N)
    distinct = F.one_hot(torch.arange(4).expand(2, 3, 4), 5).double().permute(0, 2, 1, 3)
    torch.testing.assert_close(
        rg.position_disagreement(distinct), torch.full((2,), -0.25, dtype=torch.float64)
    )


def test_head_parts_are_what_the_module_computes():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, dtype=torch.float64)
    x = rand(2, 5, 8, seed=3, grad=False)
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)
    parts = rg.head_parts(mha, x, mask=mask)
    torch.testing.assert_close(parts.output.context, mha(x, mask=mask).context)
    wv = mha.in_proj_weight.chunk(3)[2]
    bv = mha.in_proj_bias.chunk(3)[2]
    for h in range(2):
        rows = slice(4 * h, 4 * h + 4)
        v_h = x @ wv[rows].T + bv[rows]
        torch.testing.assert_close(parts.values[:, h], v_h)
        torch.testing.assert_close(parts.outputs[:, h], parts.weights[:, h] @ v_h)
    merged = parts.outputs.transpose(1, 2).flatten(-2) @ mha.out_proj.weight.T
    torch.testing.assert_close(parts.output.context, merged + mha.out_proj.bias)
    # The regularisers reach the module's parameters.
    loss = -(rg.subspace_disagreement(parts.values, mask) + rg.output_disagreement(parts.outputs))
    loss = loss + -rg.position_disagreement(parts.weights)
    loss.sum().backward()
    assert mha.in_proj_weight.grad is not None and mha.in_proj_weight.grad.abs().sum() > 0


def test_coverage_penalties_are_re_exported():
    assert rg.doubly_stochastic_penalty is ak.memory.doubly_stochastic_penalty
    assert rg.coverage_loss is ak.memory.coverage_loss


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"\(B, H, N, d\)"):
        rg.subspace_disagreement(torch.zeros(2, 5, 4))
    with pytest.raises(TypeError, match="weights"):
        rg.position_disagreement(torch.zeros(2, 2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="one entry per position"):
        rg.output_disagreement(torch.zeros(2, 2, 3, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="boolean"):
        rg.output_disagreement(torch.zeros(2, 2, 3, 4), torch.ones(2, 3))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        rg.head_parts(torch.nn.Linear(2, 2), torch.zeros(1, 2, 2))


def test_auxiliary_loss_sums_the_parts_own_penalties():
    class Part(torch.nn.Module):
        def __init__(self, value: float) -> None:
            super().__init__()
            self.value = torch.nn.Parameter(torch.tensor(value))

        def auxiliary_loss(self):
            return 2 * self.value

    model = torch.nn.Sequential(Part(1.5), torch.nn.Linear(2, 2), torch.nn.Sequential(Part(-4.0)))
    total = rg.auxiliary_loss(model)
    assert total.item() == 2 * 1.5 + 2 * -4.0
    total.backward()
    assert model[0].value.grad.item() == 2.0 and model[2][0].value.grad.item() == 2.0
    assert rg.auxiliary_loss(torch.nn.Linear(2, 2)) is None
