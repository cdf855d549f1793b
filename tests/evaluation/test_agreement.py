"""Kendall τ-b against scipy, top-k overlap by hand."""

import math

import pytest
import torch
from scipy.stats import kendalltau

from attnkit.evaluation.agreement import kendall_tau, mean_defined, top_k_overlap


def test_kendall_tau_matches_scipy_with_ties_and_kept_items():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (20, 9), generator=g).double()
    b = torch.randint(0, 4, (20, 9), generator=g).double()
    keep = torch.rand(20, 9, generator=g) > 0.2
    got = kendall_tau(a, b, keep)
    for i in range(20):
        ref = kendalltau(a[i][keep[i]].numpy(), b[i][keep[i]].numpy()).statistic
        if math.isnan(ref):
            assert math.isnan(float(got[i]))
        else:
            assert float(got[i]) == pytest.approx(ref, abs=1e-12)


def test_kendall_tau_hand_cases():
    a = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    b = torch.tensor([[10.0, 20.0, 30.0], [3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    got = kendall_tau(a, b)
    assert got[:2].tolist() == [1.0, -1.0]
    assert math.isnan(float(got[2]))  # constant row: undefined
    assert mean_defined(got) == 0.0
    # one discordant pair among three: (2 - 1) / 3
    assert float(kendall_tau(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0]))) == (
        pytest.approx(1 / 3)
    )


def test_top_k_overlap_by_hand():
    a = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1]])
    b = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.3, 0.2]])
    assert top_k_overlap(a, b, 2).tolist() == [0.0, 0.5]
    assert top_k_overlap(a, b, 4).tolist() == [1.0, 1.0]
    keep = torch.tensor([[True, False, False, True], [True, True, True, True]])
    # row 0 keeps items 0 and 3: top-2 of both is {0, 3}
    assert top_k_overlap(a, b, 2, keep).tolist() == [1.0, 0.5]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="one shape"):
        kendall_tau(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="keep"):
        top_k_overlap(torch.zeros(3), torch.zeros(3), 1, torch.ones(3))
    with pytest.raises(ValueError, match="k must"):
        top_k_overlap(torch.zeros(3), torch.zeros(3), 0)
    assert math.isnan(mean_defined(torch.tensor([math.nan])))


BAD_CALLS = [
    (
        "k above N",
        lambda: top_k_overlap(torch.rand(2, 5), torch.rand(2, 5), 7),
        ValueError,
        r"k must be at most N = 5.*got k = 7",
    ),
    (
        "k zero",
        lambda: top_k_overlap(torch.rand(2, 5), torch.rand(2, 5), 0),
        ValueError,
        r"k must be an int ≥ 1, got 0",
    ),
    (
        "float keep",
        lambda: top_k_overlap(torch.rand(5), torch.rand(5), 2, torch.ones(5)),
        TypeError,
        r"keep must be a boolean tensor.*torch.float32",
    ),
    (
        "keep of another shape",
        lambda: kendall_tau(torch.rand(5), torch.rand(5), torch.ones(4, dtype=torch.bool)),
        ValueError,
        r"keep must have the shape of a \(5,\), got \(4,\)",
    ),
    (
        "shapes differ",
        lambda: kendall_tau(torch.rand(2, 5), torch.rand(2, 4)),
        ValueError,
        r"a \(2, 5\) and b \(2, 4\) must have one shape",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_k_equal_to_n_compares_whole_rows():
    a, b = torch.rand(3, 4), torch.rand(3, 4)
    assert top_k_overlap(a, b, 4).tolist() == [1.0, 1.0, 1.0]
