"""Constrained softmax / sparsemax against solvers of the convex problems written independently."""

import math

import entmax
import numpy as np
import pytest
import torch
from helpers import rand
from scipy.optimize import minimize

import attnkit as ak
from attnkit import alignments as al

MAPS = [al.ConstrainedSoftmax, al.ConstrainedSparsemax]


def kkt_row(z, u, kind):
    """Plain-float bisection on the KKT conditions of the capped-simplex projection:
    softmax: a_l = min(u_l, exp(z_l − τ)); sparsemax: a_l = min(u_l, max(0, z_l − τ));
    τ is the root of Σ a_l(τ) = 1 (the sum falls as τ grows)."""

    def a(tau):
        if kind == "softmax":
            return [min(ul, math.exp(zl - tau)) for zl, ul in zip(z, u, strict=True)]
        return [min(ul, max(0.0, zl - tau)) for zl, ul in zip(z, u, strict=True)]

    lo, hi = min(z) - 60.0, max(z) + 60.0
    for _ in range(300):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(a(mid)) > 1 else (lo, mid)
    return a((lo + hi) / 2)


def scipy_row(z, u, kind):
    """SLSQP on argmin_{Σa = 1, 0 ≤ a ≤ u} KL(a ‖ softmax z) or ‖a − z‖²."""
    z, u = np.asarray(z), np.asarray(u)
    if kind == "softmax":
        logp = z - np.log(np.exp(z - z.max()).sum()) - z.max()

        def f(a):
            a = np.clip(a, 1e-300, None)
            return float((a * (np.log(a) - logp)).sum())
    else:

        def f(a):
            return float(((a - z) ** 2).sum())

    start = np.minimum(u, 1.0) / np.minimum(u, 1.0).sum()
    res = minimize(
        f,
        start,
        method="SLSQP",
        bounds=[(0.0, float(x)) for x in u],
        constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0}],
        options={"ftol": 1e-14, "maxiter": 500},
    )
    assert res.success, res.message
    return res.x


def bounds(*shape, seed=0, low=0.15, high=0.6):
    g = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("cls", MAPS)
def test_every_bound_respected_rows_sum_to_one(cls):
    e = 3 * rand(3, 4, 7, grad=False)
    u = bounds(3, 4, 7)
    mask = torch.ones(3, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = False
    w = cls()(e, mask, upper=u).weights
    assert (w >= 0).all() and (w <= u + 1e-12).all()
    assert (w[~mask.expand_as(w)] == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, dtype=torch.float64))
    assert (w == u).any(), "no bound was active: the test would not test them"


@pytest.mark.parametrize("upper", [None, 1.0, math.inf, 7.0])
def test_loose_bounds_give_softmax_and_sparsemax(upper):
    e = 2 * rand(2, 3, 6, seed=1, grad=False)
    u = None if upper is None else torch.full((6,), upper, dtype=torch.float64)
    torch.testing.assert_close(
        al.ConstrainedSoftmax()(e, upper=u).weights, torch.softmax(e, -1), atol=1e-13, rtol=0
    )
    torch.testing.assert_close(
        al.ConstrainedSparsemax()(e, upper=u).weights,
        entmax.sparsemax(e, dim=-1),
        atol=1e-13,
        rtol=0,
    )


@pytest.mark.parametrize(("cls", "kind"), [(MAPS[0], "softmax"), (MAPS[1], "sparsemax")])
def test_matches_the_kkt_bisection(cls, kind):
    e = 2 * rand(4, 3, 6, seed=2, grad=False)
    u = bounds(4, 3, 6, seed=3)
    u[0, 0, 2] = math.inf  # an unbounded key beside bounded ones
    u[1, 1, :3] = 0.0  # keys with no budget left
    w = cls()(e, upper=u).weights
    assert (w == u).sum() >= 4, "too few active bounds for the test to test them"
    for i in range(4):
        for m in range(3):
            ref = kkt_row(e[i, m].tolist(), u[i, m].tolist(), kind)
            torch.testing.assert_close(
                w[i, m], torch.tensor(ref, dtype=torch.float64), atol=1e-11, rtol=0
            )


@pytest.mark.parametrize(("cls", "kind"), [(MAPS[0], "softmax"), (MAPS[1], "sparsemax")])
def test_matches_a_generic_convex_solver(cls, kind):
    e = 2 * rand(2, 2, 5, seed=4, grad=False)
    u = bounds(2, 2, 5, seed=5, low=0.22)
    w = cls()(e, upper=u).weights
    assert (w == u).sum() >= 2, "too few active bounds for the test to test them"
    for i in range(2):
        for m in range(2):
            ref = scipy_row(e[i, m].numpy(), u[i, m].numpy(), kind)
            torch.testing.assert_close(
                w[i, m], torch.from_numpy(ref).to(torch.float64), atol=2e-6, rtol=0
            )


@pytest.mark.parametrize("cls", MAPS)
def test_gradcheck_scores_and_bounds(cls):
    e = 2 * rand(2, 2, 5, seed=6)
    u = bounds(2, 2, 5, seed=7, low=0.25).requires_grad_()
    mask = torch.tensor([True, True, True, False, True])
    align = cls()
    w = align(e, mask, upper=u).weights
    active = ((w - u).abs() < 1e-12) & mask
    assert active.any() and (~active & mask & (w > 0)).any()
    assert torch.autograd.gradcheck(lambda e, u: align(e, mask, upper=u).weights, (e, u))


@pytest.mark.parametrize("cls", MAPS)
def test_masks_fully_masked_rows_and_nan_at_masked_keys(cls):
    e = rand(2, 3, 5, seed=8, grad=False).clone()
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[0, 1] = False
    mask[1, :, 0] = False
    e[1, :, 0] = float("nan")
    w = cls(0.5)(e, mask).weights
    assert torch.isfinite(w).all() and (w[0, 1] == 0).all() and (w[1, :, 0] == 0).all()
    removed = cls(0.5)(e[1:, :, 1:]).weights
    torch.testing.assert_close(w[1:, :, 1:], removed)


@pytest.mark.parametrize("cls", MAPS)
def test_a_constant_added_to_a_row_changes_nothing(cls):
    e = rand(2, 3, 6, seed=9, grad=False)
    u = bounds(2, 3, 6, seed=10)
    base = cls()(e, upper=u).weights
    torch.testing.assert_close(cls()(e + 1e6, upper=u).weights, base, atol=1e-9, rtol=0)
    half = cls()(e.to(torch.bfloat16), upper=u.float()).weights
    assert half.dtype == torch.bfloat16 and torch.isfinite(half.float()).all()


@pytest.mark.parametrize("cls", MAPS)
def test_fertility_budgets_over_a_decoding(cls):
    """Martins & Kreutzer's use: u_t = fertility − attention received so far; over a whole
    decoding no key gets more than its fertility."""
    g = torch.Generator().manual_seed(11)
    fertility = torch.tensor([2.0, 1.0, 0.5, 1.0, 0.5], dtype=torch.float64)
    received = torch.zeros(5, dtype=torch.float64)
    align = cls()
    for _ in range(5):
        e = 3 * torch.randn(5, generator=g, dtype=torch.float64)
        a = align(e[None, None], upper=(fertility - received).clamp_min(0)).weights[0, 0]
        received = received + a
    assert (received <= fertility + 1e-12).all()
    torch.testing.assert_close(received.sum(), torch.tensor(5.0, dtype=torch.float64))


@pytest.mark.parametrize("cls", MAPS)
def test_bad_bounds_are_refused(cls):
    e = rand(1, 2, 4, grad=False)
    with pytest.raises(ValueError, match="sum to"):
        cls(0.2)(e)
    with pytest.raises(ValueError, match="sum to"):
        cls()(e, torch.tensor([True, False, False, True]), upper=0.4)
    with pytest.raises(ValueError, match="broadcast"):
        cls()(e, upper=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=">= 0"):
        cls()(e, upper=-torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="upper"):
        cls()(e, upper="half")
    with pytest.raises(ValueError, match="> 0"):
        cls(0.0)
    with pytest.raises(TypeError, match="upper"):
        cls(True)


@pytest.mark.parametrize("cls", MAPS)
def test_the_chunked_kernel_streams_the_module_bound(cls):
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = ak.masks.from_lengths(torch.tensor([9, 6]), 9)
    align = cls(0.3)
    assert align.streamable
    dense = ak.attention(3 * q, k, v, align=align, mask=mask, kernel="dense", need_weights=True)
    assert (dense.weights == 0.3).any(), "no bound was active: the test would not test them"
    chunked = ak.attention(3 * q, k, v, align=align, mask=mask, chunk_size=2)
    torch.testing.assert_close(chunked.context, dense.context, atol=1e-12, rtol=0)
    r = torch.randn(dense.context.shape, generator=g, dtype=torch.float64)
    g1 = torch.autograd.grad((dense.context * r).sum(), [q, k, v])
    g2 = torch.autograd.grad((chunked.context * r).sum(), [q, k, v])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="sum to"):
        ak.attention(q, k, v, align=cls(0.1), mask=mask, chunk_size=2)
