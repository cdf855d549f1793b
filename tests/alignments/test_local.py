"""Local alignment against a loop from Brauwers eqs. 27-29."""

import math

import pytest
import torch
from alignments.rows import per_row
from helpers import assert_same_forward_backward, rand
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from attnkit import alignments as al


def local_row(e, allowed, p, window, gaussian):
    """Brauwers eqs. 27 and 29 for one row: the window is every key l with p − D ≤ l ≤ p + D."""
    p = torch.as_tensor(p, dtype=e.dtype)
    lo, hi = float(p.detach()) - window, float(p.detach()) + window
    inside = [allowed[j] and lo <= j <= hi for j in range(len(e))]
    if not any(inside):
        return e * 0
    denom = sum(torch.exp(e[j]) for j in range(len(e)) if inside[j])
    out = []
    for j in range(len(e)):
        a = torch.exp(e[j]) / denom if inside[j] else e[j] * 0  # eq. 27
        if gaussian:
            sigma = window / 2
            a = a * torch.exp(-((j - p) ** 2) / (2 * sigma**2))  # eq. 29
        out.append(a)
    return torch.stack(out)


@pytest.mark.parametrize("gaussian", [False, True])
def test_monotonic(gaussian):
    e = rand(2, 4, 7)
    mask = torch.ones(2, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = False
    align = al.Local(2, gaussian=gaussian)
    assert_same_forward_backward(
        lambda: align(e, mask).weights,
        lambda: per_row(lambda r, a, m: local_row(r, a, m, 2, gaussian), e, mask),
        [e],
        atol=1e-12,
        rtol=1e-12,
    )


def test_predictive_eq28():
    torch.manual_seed(0)
    align = al.Local(2, "predictive", d_q=5, d_p=4, dtype=torch.float64)
    e, q = rand(2, 3, 8, seed=1), rand(2, 3, 5, seed=2)
    mask = torch.ones(2, 1, 8, dtype=torch.bool)
    mask[1, :, 6:] = False
    Wp, wp = align.W_p.weight, align.w_p.weight  # wp: (1, d_p)

    def loop():
        rows = []
        for i in range(2):
            s = int(mask[i, 0].sum())
            ps = [(s - 1) * torch.sigmoid(wp[0] @ torch.tanh(Wp @ q[i, m])) for m in range(3)]
            rows.append(
                torch.stack(
                    [local_row(e[i, m], mask[i, 0].tolist(), ps[m], 2, True) for m in range(3)]
                )
            )
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: align(e, mask, query=q).weights, loop, [e, q, Wp, wp], atol=1e-12, rtol=1e-12
    )


def test_window_larger_than_sequence_keeps_the_keys_inside():
    e = torch.randn(1, 2, 5, dtype=torch.float64)
    w = al.Local(3)(e).weights
    for t in range(2):  # p = t, window [t − 3, t + 3] ∩ [0, 5)
        inside = [j for j in range(5) if abs(j - t) <= 3]
        ref = torch.zeros(5, dtype=torch.float64)
        ref[inside] = torch.softmax(e[0, t, inside], dim=-1)
        torch.testing.assert_close(w[0, t], ref)


def test_predictive_needs_query_size_and_query():
    with pytest.raises(TypeError, match="d_q"):
        al.Local(1, "predictive")
    with pytest.raises(ValueError, match="query"):
        al.Local(1, "predictive", d_q=3)(torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match="position"):
        al.Local(1, "sideways")


def test_gaussian_sigma():
    # Weight at distance D from p is the window softmax times exp(-2) (σ = D/2).
    align = al.Local(2, gaussian=True)
    e = torch.zeros(1, 3, 7, dtype=torch.float64)
    w = align(e).weights
    torch.testing.assert_close(w[0, 2, 4], torch.tensor(math.exp(-2) / 5, dtype=torch.float64))


def _predictor_at_half(align):
    """Zero W_p: tanh(0) = 0, so eq. 28 gives p = (S − 1)·sigmoid(0) = (S − 1)/2."""
    with torch.no_grad():
        align.W_p.weight.zero_()
    return align


@pytest.mark.parametrize("gaussian", [False, True])
def test_predictive_window_is_p_minus_d_to_p_plus_d(gaussian):
    # S = 6 keys: p = 2.5 and D = 1 -> the window [1.5, 3.5] holds keys 2 and 3 only (not the
    # three keys around round(p)); key 1 or 4 must neither get weight nor enter the normaliser.
    align = _predictor_at_half(al.Local(1, "predictive", d_q=3, gaussian=gaussian).double())
    e, q = rand(1, 2, 6, seed=3), rand(1, 2, 3, seed=4)
    w = align(e, query=q).weights
    assert (w[..., [0, 1, 4, 5]] == 0).all()
    ref = per_row(lambda r, a, m: local_row(r, a, 2.5, 1, gaussian), e)
    assert_same_forward_backward(
        lambda: align(e, query=q).weights, lambda: ref, [e], atol=1e-12, rtol=1e-12
    )
    if not gaussian:
        soft = torch.softmax(e[..., 2:4], dim=-1)
        torch.testing.assert_close(w[..., 2:4], soft)


def test_predictive_with_mask_counts_only_real_keys():
    # S = 4 real keys of 7: p = 1.5, window [0.5, 2.5] -> keys 1 and 2.
    align = _predictor_at_half(al.Local(1, "predictive", d_q=3, gaussian=False).double())
    e, q = rand(1, 1, 7, seed=5), rand(1, 1, 3, seed=6)
    mask = torch.tensor([[[True] * 4 + [False] * 3]])
    w = align(e, mask, query=q).weights
    torch.testing.assert_close(w[0, 0, 1:3], torch.softmax(e[0, 0, 1:3], -1))
    assert w[0, 0, [0, 3, 4, 5, 6]].abs().sum() == 0


@pytest.mark.parametrize("gaussian", [False, True])
def test_monotonic_explicit_positions(gaussian):
    # A decoder at steps 4, 0 and 9 (beyond the 7 keys: an empty window, weights 0).
    e = rand(2, 3, 7)
    mask = torch.ones(2, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = False
    steps = torch.tensor([4, 0, 9])
    align = al.Local(1, gaussian=gaussian)
    assert_same_forward_backward(
        lambda: align(e, mask, positions=steps).weights,
        lambda: per_row(lambda r, a, m: local_row(r, a, int(steps[m]), 1, gaussian), e, mask),
        [e],
        atol=1e-12,
        rtol=1e-12,
    )
    assert (align(e, mask, positions=steps).weights[:, 2] == 0).all()


def test_monotonic_position_per_batch_item_and_int():
    e = rand(2, 1, 6)
    align = al.Local(1)
    w = align(e, positions=torch.tensor([[1], [3]])).weights
    ref = torch.stack(
        [local_row(e[0, 0], [True] * 6, 1, 1, False), local_row(e[1, 0], [True] * 6, 3, 1, False)]
    )
    torch.testing.assert_close(w[:, 0], ref)
    torch.testing.assert_close(
        align(e, positions=3).weights[1, 0], local_row(e[1, 0], [True] * 6, 3, 1, False)
    )


@pytest.mark.parametrize(
    ("positions", "error", "match"),
    [
        (torch.tensor([1.0, 2.0]), TypeError, "positions must be an integer tensor, got dtype"),
        (torch.tensor([True, False]), TypeError, "positions must be an integer tensor"),
        (torch.tensor([1, 2, 3]), ValueError, r"positions of shape \(3,\) does not broadcast"),
        (1.5, TypeError, "positions must be an int or an integer tensor"),
        (True, TypeError, "positions must be an int or an integer tensor"),
    ],
)
def test_bad_positions(positions, error, match):
    with pytest.raises(error, match=match):
        al.Local(1)(torch.randn(1, 2, 5), positions=positions)


def test_predictive_refuses_positions():
    with pytest.raises(ValueError, match="positions= is for monotonic"):
        al.Local(1, "predictive", d_q=3)(
            torch.randn(1, 2, 5), query=torch.randn(1, 2, 3), positions=1
        )


def test_bfloat16_positions_beyond_256_are_exact():
    # bfloat16 cannot hold 257; the window must still be [p − D, p + D] in exact indices.
    e = torch.zeros(1, 1, 300, dtype=torch.bfloat16)
    w = al.Local(1)(e, positions=257).weights
    assert w[0, 0].nonzero().flatten().tolist() == [256, 257, 258]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    window=st.integers(0, 3),
    gaussian=st.booleans(),
    data=st.data(),
)
def test_property_monotonic_matches_eqs_27_29(n, window, gaussian, data):
    """Any sequence length (windows crossing either end), any step, any mask."""
    assume(not (gaussian and window == 0))  # σ = D/2 needs D >= 1
    e = torch.tensor(
        data.draw(st.lists(st.floats(-30, 30), min_size=2 * n, max_size=2 * n)),
        dtype=torch.float64,
    ).reshape(1, 2, n)
    allowed = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    steps = data.draw(st.lists(st.integers(0, n + 3), min_size=2, max_size=2))
    mask = torch.tensor(allowed).reshape(1, 1, n)
    w = al.Local(window, gaussian=gaussian)(e, mask, positions=torch.tensor(steps)).weights
    ref = torch.stack([local_row(e[0, m], allowed, steps[m], window, gaussian) for m in range(2)])
    torch.testing.assert_close(w[0], ref, atol=1e-12, rtol=1e-12)
    assert torch.isfinite(w).all()
