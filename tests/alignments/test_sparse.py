"""Sparsemax and α-entmax against loops from their definitions and against the entmax package."""

import entmax
import pytest
import torch
from alignments.rows import per_row
from helpers import assert_same_forward_backward, rand

from attnkit import alignments as al


def sparsemax_row(e, allowed, _m):
    """Martins & Astudillo: sort, find the support size k(z), threshold τ, p = [z − τ]_+."""
    z = [e[j] for j in range(len(e)) if allowed[j]]
    order = sorted(range(len(z)), key=lambda j: -float(z[j].detach()))
    cumulative, support, total = 0.0, 0, 0.0
    for rank, j in enumerate(order, start=1):
        cumulative = cumulative + z[j]
        if 1 + rank * z[j] > cumulative:
            support, total = rank, cumulative
    tau = (total - 1) / support
    vals = iter([torch.clamp(zj - tau, min=0) for zj in z])
    return torch.stack([next(vals) if allowed[j] else e[j] * 0 for j in range(len(e))])


def entmax_row(e, allowed, _m, alpha):
    """α-entmax by bisection on τ: p_j = [(α−1) z_j − τ]_+^{1/(α−1)}, Σ p = 1."""
    z = torch.stack([e[j] for j in range(len(e)) if allowed[j]]).detach() * (alpha - 1)
    lo, hi = float(z.max()) - 1.0, float(z.max())
    for _ in range(200):
        tau = (lo + hi) / 2
        total = float((torch.clamp(z - tau, min=0) ** (1 / (alpha - 1))).sum())
        lo, hi = (tau, hi) if total > 1 else (lo, tau)
    p = iter(torch.clamp(z - (lo + hi) / 2, min=0) ** (1 / (alpha - 1)))
    return torch.stack([next(p) if allowed[j] else e[j].detach() * 0 for j in range(len(e))])


def _mask():
    mask = torch.rand(2, 3, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 1] = True
    return mask


def test_sparsemax_definition():
    e, mask = rand(2, 3, 6) * 2, _mask()
    assert_same_forward_backward(
        lambda: al.Sparsemax()(e, mask).weights, lambda: per_row(sparsemax_row, e, mask), [e]
    )
    assert (al.Sparsemax()(e, mask).weights == 0).any(), "sparsemax should give exact zeros"


@pytest.mark.parametrize(
    ("align", "alpha"),
    [(al.Entmax15(), 1.5), (al.Entmax(1.3), 1.3), (al.Entmax(1.8), 1.8), (al.Entmax(2.0), 2.0)],
)
def test_entmax_definition(align, alpha):
    e, mask = rand(2, 3, 6) * 2, _mask()
    ref = per_row(lambda r, a, m: entmax_row(r, a, m, alpha), e, mask)
    # Bisection (50 steps) is exact to ~1e-8; sorting-based 1.5-entmax to rounding.
    torch.testing.assert_close(align(e, mask).weights.detach(), ref, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (al.Sparsemax(), lambda x: entmax.sparsemax(x, dim=-1)),
        (al.Entmax15(), lambda x: entmax.entmax15(x, dim=-1)),
        (al.Entmax(1.25), lambda x: entmax.entmax_bisect(x, 1.25, dim=-1)),
    ],
)
def test_parity_with_entmax_package_on_unmasked_and_truncated_rows(ours, theirs):
    e = rand(2, 3, 7) * 3
    assert_same_forward_backward(lambda: ours(e).weights, lambda: theirs(e), [e], atol=1e-9)
    # A masked tail equals the package on the truncated rows.
    mask = torch.ones(1, 1, 7, dtype=torch.bool)
    mask[..., 5:] = False
    torch.testing.assert_close(
        ours(e, mask).weights[..., :5], theirs(e[..., :5]), atol=1e-9, rtol=1e-7
    )


def test_learned_alpha():
    align = al.Entmax(1.6, learnable=True)
    torch.testing.assert_close(align.alpha.detach(), torch.tensor(1.6))
    w = align(rand(2, 3, 6) * 2).weights
    (w * torch.arange(6.0, dtype=w.dtype)).sum().backward()
    assert align.rho.grad is not None and align.rho.grad != 0


def test_bad_alpha():
    with pytest.raises(ValueError, match="alpha"):
        al.Entmax(1.0)


@pytest.mark.parametrize("align", [al.Sparsemax(), al.Entmax15(), al.Entmax(1.3)])
@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e8), (torch.bfloat16, 1e3)])
def test_masked_rows_keep_their_mass_at_large_logits(align, dtype, scale):
    e = (scale + torch.randn(2, 3, 6)).to(dtype)
    mask = torch.ones(2, 3, 6, dtype=torch.bool)
    mask[..., 4:] = False
    w = align(e, mask).weights.float()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3), atol=1e-2, rtol=0)
    assert (w[..., 4:] == 0).all()


@pytest.mark.parametrize("offset", [1e4, -1e4])
def test_bisection_is_shift_invariant(offset):
    e = torch.randn(2, 3, 6, dtype=torch.float64)
    align = al.Entmax(1.3)
    torch.testing.assert_close(align(e + offset).weights, align(e).weights, atol=1e-8, rtol=0)


@pytest.mark.parametrize(("offset", "dtype"), [(1e30, torch.float64), (-1e30, torch.float32)])
def test_bisection_is_finite_at_huge_logits(offset, dtype):
    # at 1e30 the row's differences are below rounding: every key ties, weights are uniform
    w = al.Entmax(1.3)(torch.randn(2, 3, 6, dtype=dtype) + offset).weights
    torch.testing.assert_close(w, torch.full_like(w, 1 / 6))


def test_fixed_alpha_is_exact_and_learned_alpha_follows_double():
    e = torch.randn(2, 3, 6, dtype=torch.float64)
    ref = per_row(lambda r, a, m: entmax_row(r, a, m, 1.3), e, torch.ones(2, 3, 6, dtype=bool))
    torch.testing.assert_close(al.Entmax(1.3, n_iter=80)(e).weights, ref, atol=1e-12, rtol=0)
    learned = al.Entmax(1.3, learnable=True).double()
    assert learned.rho.dtype == torch.float64
    assert abs(learned.alpha_value() - 1.3) < 1e-7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": float("inf")}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"n_iter": 0}, "n_iter"),
        ({"n_iter": 2.5}, "n_iter"),
    ],
)
def test_bad_entmax_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        al.Entmax(**kwargs)


def test_large_alpha_builds_and_is_close_to_sparse():
    w = al.Entmax(1000)(torch.tensor([[3.0, 1.0, 0.5]])).weights
    assert torch.isfinite(w).all() and abs(float(w.sum()) - 1) < 1e-5
