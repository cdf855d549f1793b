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
