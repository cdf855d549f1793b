"""Intrinsic metrics on hand-computed examples."""

import math

import pytest
import torch

from attnkit.evaluation import (
    alignment_error_rate,
    attention_correctness,
    entropy,
    rank_correlation,
)


def test_aer_hand_computed():
    # 2 outputs × 3 inputs. Argmax links: (0, 1), (1, 2).
    w = torch.tensor([[0.1, 0.7, 0.2], [0.3, 0.3, 0.4]])
    sure = torch.tensor([[False, True, False], [True, False, False]])
    possible = torch.tensor([[False, True, True], [True, False, True]])
    # A = {(0,1), (1,2)}, S = {(0,1), (1,0)}, P = S ∪ {(0,2), (1,2)}
    # |A∩S| = 1, |A∩P| = 2, |A| = 2, |S| = 2 -> AER = 1 - 3/4
    assert alignment_error_rate(w, sure, possible) == pytest.approx(0.25)
    # Threshold 0.25: A = {(0,1), (1,0), (1,1), (1,2)}: |A∩S| = 2, |A∩P| = 3, |A| = 4 -> 1 - 5/6
    assert alignment_error_rate(
        w, sure, possible, mode="threshold", threshold=0.25
    ) == pytest.approx(1 - 5 / 6)
    # Only row 0 counts.
    assert alignment_error_rate(w, sure, possible, rows=torch.tensor([True, False])) == 0.0


def test_aer_rejects_bad_input():
    w = torch.rand(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        alignment_error_rate(
            w, torch.zeros(2, 4, dtype=torch.bool), torch.zeros(2, 4, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="mode"):
        alignment_error_rate(w, w > 2, w > 2, mode="top2")


def test_attention_correctness_eq46():
    w = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    region = torch.tensor([[True, True, False], [False, False, True]])
    assert attention_correctness(w, region) == pytest.approx((0.8 + 0.8) / 2)


def test_rank_correlation_spearman():
    a = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    assert rank_correlation(a, a * 10) == pytest.approx(1.0)
    assert rank_correlation(a, a.flip(-1)) == pytest.approx(-1.0)
    # With ties: ranks of [1, 2, 2, 3] are [0, 1.5, 1.5, 3]; against [0, 1, 2, 3].
    b = torch.tensor([[1.0, 2.0, 2.0, 3.0]])
    ra = torch.tensor([0, 1.5, 1.5, 3]) - 1.5
    rb = torch.tensor([0.0, 1, 2, 3]) - 1.5
    expected = float((ra * rb).sum() / (ra.norm() * rb.norm()))
    assert rank_correlation(b, a) == pytest.approx(expected)


def test_entropy():
    assert entropy(torch.tensor([[0.5, 0.5, 0.0]])) == pytest.approx(math.log(2))
    assert entropy(torch.tensor([[1.0, 0.0]])) == 0.0


def _w(*shape):
    return torch.rand(*shape).softmax(-1)


def _b(*shape):
    return torch.ones(*shape, dtype=torch.bool)


BAD_CALLS = [
    (
        "region of another width",
        lambda: attention_correctness(_w(2, 5), _b(2, 4)),
        ValueError,
        r"region of shape \(2, 4\) does not broadcast to \(2, 5\)",
    ),
    (
        "float region",
        lambda: attention_correctness(_w(2, 5), torch.full((2, 5), 0.5)),
        TypeError,
        r"region must be boolean.*torch.float32.*region.bool\(\)",
    ),
    (
        "integer weights",
        lambda: attention_correctness(torch.ones(2, 5, dtype=torch.long), _b(2, 5)),
        TypeError,
        r"weights must be a floating-point tensor.*torch.int64",
    ),
    (
        "rank: shapes differ",
        lambda: rank_correlation(_w(2, 5), _w(2, 4)),
        ValueError,
        r"reference has shape \(2, 4\) but weights has \(2, 5\)",
    ),
    (
        "rank: boolean reference",
        lambda: rank_correlation(_w(2, 5), _b(2, 5)),
        TypeError,
        r"reference must be a real tensor.*torch.bool",
    ),
    (
        "rank: not a tensor",
        lambda: rank_correlation([0.1, 0.9], _w(2)),
        TypeError,
        r"weights must be a torch.Tensor",
    ),
    (
        "entropy: negative weights",
        lambda: entropy(torch.tensor([[-0.5, 1.5]])),
        ValueError,
        r"weights must be non-negative.*-0.5 at index \(0, 0\)",
    ),
    (
        "entropy: NaN weights",
        lambda: entropy(torch.tensor([[math.nan, 1.0]])),
        ValueError,
        r"weights must be non-negative.*nan",
    ),
    (
        "entropy: integer weights",
        lambda: entropy(torch.ones(2, 3, dtype=torch.long)),
        TypeError,
        r"weights must be a floating-point",
    ),
    (
        "aer: float sure links",
        lambda: alignment_error_rate(_w(2, 3), torch.ones(2, 3), _b(2, 3)),
        TypeError,
        r"sure must be boolean \(True = a gold link\)",
    ),
    (
        "aer: float rows",
        lambda: alignment_error_rate(_w(2, 3), _b(2, 3), _b(2, 3), rows=torch.ones(2)),
        TypeError,
        r"rows must be boolean",
    ),
    (
        "aer: rows of the wrong shape",
        lambda: alignment_error_rate(_w(2, 3), _b(2, 3), _b(2, 3), rows=_b(3)),
        ValueError,
        r"rows of shape \(3,\) does not broadcast to \(2,\)",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_region_broadcasts_over_rows():
    # One region for every glimpse of an example: (B, 1, N) against weights (B, T, N).
    w = torch.tensor([[[0.2, 0.8], [0.6, 0.4]]])
    region = torch.tensor([[[False, True]]])
    assert attention_correctness(w, region) == pytest.approx((0.8 + 0.4) / 2)
