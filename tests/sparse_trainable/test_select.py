"""The shared helpers of the trainable sparse parts: top-n selection against a stable sort, the
finite check against ``torch.isfinite``."""

from __future__ import annotations

import pytest
import torch

from attnkit.sparse_trainable._select import (
    all_finite,
    top_indices,
    top_mask,
    top_set,
)


@pytest.mark.parametrize("count", [1, 3, 7, 12, 20])
def test_top_indices_are_the_set_a_stable_sort_puts_first(count):
    """Ties (many, from a coarse grid), ±inf and NaN: the same set as the first ``count`` of a
    stable descending sort (ties by index, NaN as −inf), in index order."""
    g = torch.Generator().manual_seed(count)
    score = torch.randint(0, 4, (50, 12), generator=g).double()
    score[score == 0] = float("-inf")
    score[:, 3] = torch.where(torch.rand(50, generator=g) < 0.3, float("inf"), score[:, 3])
    score[::7, 5] = float("nan")
    index, available = top_indices(score, count)
    inf = float("inf")
    clean = torch.where(score.isnan(), -inf, score)  # −inf stays −inf: not available
    order = torch.sort(clean, dim=-1, descending=True, stable=True).indices[:, : min(count, 12)]
    want = order.sort(-1).values
    assert torch.equal(index, want)
    assert torch.equal(available, torch.gather(clean, -1, want) > float("-inf"))


def test_top_indices_of_nothing():
    index, available = top_indices(torch.zeros(0, 4), 2)
    assert index.shape == (0, 2) and available.shape == (0, 2)


def test_top_indices_without_ties_are_the_highest_in_index_order():
    g = torch.Generator().manual_seed(0)
    score = torch.randn(30, 40, generator=g, dtype=torch.float64)
    score[:, 35:] = float("-inf")  # unavailable, never chosen while others remain
    index, available = top_indices(score, 9)
    want = torch.sort(score, dim=-1, descending=True).indices[:, :9].sort(-1).values
    assert torch.equal(index, want) and available.all()


def test_top_indices_unordered_is_the_same_set():
    g = torch.Generator().manual_seed(3)
    score = torch.randn(20, 30, generator=g, dtype=torch.float64)
    score[:5, 10:] = float("-inf")  # ties at the bar: the tie path
    for count in (4, 12):
        index, available = top_indices(score, count)
        loose, loose_available = top_indices(score, count, ordered=False)
        order = loose.sort(-1)
        assert torch.equal(order.values, index)
        assert torch.equal(torch.gather(loose_available, -1, order.indices), available)


@pytest.mark.parametrize("ordered", [True, False])
def test_top_indices_of_every_entry_mark_the_minus_inf_ones_unavailable(ordered):
    """count = K: no tie outside the set, every entry taken; those at −inf (or NaN) are not
    available, wherever topk puts them."""
    g = torch.Generator().manual_seed(5)
    score = torch.randn(6, 7, generator=g)
    score[0, 2] = score[3, 6] = float("-inf")
    score[4, 1] = float("nan")
    index, available = top_indices(score, 7, ordered=ordered)
    taken = index.sort(-1)
    assert torch.equal(taken.values, torch.arange(7).expand(6, 7))
    want = torch.ones(6, 7, dtype=torch.bool)
    want[0, 2] = want[3, 6] = want[4, 1] = False
    assert torch.equal(torch.gather(available, -1, taken.indices), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [0, 1, 5, 16, 40])
def test_unordered_top_indices_of_special_values_are_the_set_a_stable_sort_puts_first(count, dtype):
    """Scores with ties, ±inf, NaN, −0 and negative values: the same set as the first
    ``count`` of a stable descending sort (ties by index, NaN as −inf, −0 equal to +0), with
    the same availability."""
    g = torch.Generator().manual_seed(count)
    score = (torch.randint(-3, 4, (60, 33), generator=g) * 0.5).to(dtype)
    r = torch.rand(60, 33, generator=g)
    score[r < 0.1] = float("inf")
    score[(r >= 0.1) & (r < 0.2)] = float("-inf")
    score[(r >= 0.2) & (r < 0.25)] = float("nan")
    score[(r >= 0.25) & (r < 0.3)] = -0.0
    score[40:] = torch.randn(20, 33, generator=g, dtype=dtype)  # no ties
    index, available = top_indices(score, count, ordered=False)
    inf = float("inf")
    clean = torch.where(score.isnan(), -inf, score) + 0.0  # −0 → +0 for the sort's ties
    take = min(count, 33)
    order = torch.sort(clean, dim=-1, descending=True, stable=True).indices[:, :take]
    want = order.sort(-1)
    got = index.sort(-1)
    assert torch.equal(got.values, want.values)
    assert torch.equal(
        torch.gather(available, -1, got.indices), torch.gather(clean, -1, want.values) > -inf
    )


def test_all_finite_agrees_with_isfinite():
    """A finite sum settles it; a sum that overflows (finite entries) and a NaN or an infinity
    anywhere take the check by slices."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 8, generator=g)
    assert all_finite(x, x[0])
    big = torch.full((3, 40, 8), 3e38)  # finite, its sum overflows
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 49, 7] = bad
        assert not all_finite(x, y)
        assert not all_finite(y.flatten())
    assert all_finite(torch.zeros(0, 4))


def _stable_top_set(score, count):
    """The available entries of the first ``count`` of a stable descending sort (ties by index,
    NaN as −inf, −inf not available), as a bool (R, K)."""
    clean = torch.where(score.isnan(), float("-inf"), score)
    order = torch.sort(clean, dim=-1, descending=True, stable=True).indices[:, :count]
    chosen = torch.zeros(score.shape, dtype=torch.bool).scatter_(1, order, True)
    return chosen & (clean > float("-inf"))


def _random_rows(kind, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        score = torch.randn(40, 37, generator=g, dtype=dtype)
    elif kind == "ties":  # a coarse grid: ties at the border in most rows
        score = torch.randint(-2, 3, (40, 37), generator=g).to(dtype) * 0.5
    elif kind == "equal":
        score = torch.full((40, 37), 1.25, dtype=dtype)
    else:  # ties, ±inf, NaN and −0
        score = torch.randint(-2, 3, (40, 37), generator=g).to(dtype)
        r = torch.rand(40, 37, generator=g)
        score[r < 0.15] = float("inf")
        score[(r >= 0.15) & (r < 0.35)] = float("-inf")
        score[(r >= 0.35) & (r < 0.45)] = float("nan")
        score[(r >= 0.45) & (r < 0.5)] = -0.0
        score[3] = float("-inf")  # a row with nothing available
        score[4] = float("nan")
    return score


@pytest.mark.parametrize("kind", ["distinct", "ties", "equal", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [0, 1, 5, 18, 36, 37, 50])
def test_top_mask_marks_the_set_a_stable_sort_puts_first(kind, dtype, count):
    """Random rows, rows with many ties, all-equal rows, ±inf, NaN, −0, count ≥ the row's
    length: 0 exactly at the available entries of the first ``count`` of a stable descending
    sort, −inf elsewhere; the same set as :func:`top_indices`; ``has`` where a row has one."""
    score = _random_rows(kind, dtype, seed=count)
    want = _stable_top_set(score, count)
    index, available = top_indices(score, count)
    from_indices = torch.zeros(score.shape, dtype=torch.bool)
    from_indices[torch.arange(40)[:, None].expand_as(index)[available], index[available]] = True
    assert torch.equal(from_indices, want)
    mask, has = top_mask(score.clone(), count)
    assert mask.dtype == dtype and mask.shape == score.shape
    assert torch.equal(mask == 0, want)
    assert bool((mask[~want] == float("-inf")).all())
    assert torch.equal(has, want.any(-1))


def test_top_mask_writes_over_the_scores():
    score = torch.randn(3, 10)
    mask, _ = top_mask(score, 4)
    assert mask.data_ptr() == score.data_ptr()
    assert torch.equal((mask == 0).sum(-1), torch.full((3,), 4))


@pytest.mark.parametrize("reversed_topk", [False, True])
@pytest.mark.parametrize("kind", ["distinct", "ties", "equal", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("count", [0, 1, 5, 18, 36, 37, 50])
def test_top_set_is_the_set_a_stable_sort_puts_first(
    monkeypatch, kind, dtype, count, reversed_topk
):
    """The same rows as for :func:`top_mask`: ``count`` distinct entries per row whose
    available ones (value above −inf) are those of a stable descending sort, the values the
    scores there (NaN as −inf); rows of (2, 20, 37) as well. Also with topk's results in
    another order (its lowest value not last)."""
    if reversed_topk:
        topk = torch.topk

        def flipped(*args, **kwargs):
            values, indices = topk(*args, **kwargs)
            return values.flip(-1), indices.flip(-1)

        monkeypatch.setattr(torch, "topk", flipped)
    score = _random_rows(kind, dtype, seed=count)
    want = _stable_top_set(score, count)
    index, values = top_set(score.view(2, 20, 37), count)
    index, values = index.reshape(40, -1), values.reshape(40, -1)
    assert index.shape == (40, min(count, 37))
    assert bool((index.sort(-1).values.diff(dim=-1) > 0).all())  # distinct
    clean = torch.where(score.isnan(), float("-inf"), score)
    assert torch.equal(values, torch.gather(clean, -1, index))
    got = torch.zeros(score.shape, dtype=torch.bool)
    available = values > float("-inf")
    got[torch.arange(40)[:, None].expand_as(index)[available], index[available]] = True
    assert torch.equal(got, want)
