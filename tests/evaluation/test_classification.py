import random
import warnings

import pytest
import torch
from sklearn.metrics import precision_recall_fscore_support

from attnkit.evaluation.classification import precision_recall_f1


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", None])
@pytest.mark.parametrize("zero_division", [0.0, 1.0])
def test_matches_scikit_learn(average, zero_division):
    rng = random.Random(0)
    for trial in range(25):
        n, k = rng.randint(1, 12), rng.randint(1, 5)
        y_true = [rng.randrange(k) for _ in range(n)]
        y_pred = [rng.randrange(k) for _ in range(n)]
        labels = None if trial % 3 else rng.sample(range(k + 1), rng.randint(1, k + 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scikit-learn warns on zero division
            p, r, f, s = precision_recall_fscore_support(
                y_true, y_pred, average=average, labels=labels, zero_division=zero_division
            )
        ours = precision_recall_f1(
            y_true, y_pred, average=average, labels=labels, zero_division=zero_division
        )
        if average is None:
            assert ours.precision == pytest.approx(p.tolist())
            assert ours.recall == pytest.approx(r.tolist())
            assert ours.f1 == pytest.approx(f.tolist())
            assert ours.support == s.tolist()
        else:
            assert (ours.precision, ours.recall, ours.f1) == pytest.approx((p, r, f))


def test_tensors_strings_and_micro_equals_accuracy():
    y_true = torch.tensor([0, 1, 2, 2, 1, 0, 0])
    y_pred = torch.tensor([0, 2, 2, 2, 1, 1, 0])
    micro = precision_recall_f1(y_true, y_pred, average="micro")
    accuracy = float((y_true == y_pred).double().mean())
    assert micro.precision == micro.recall == micro.f1 == pytest.approx(accuracy)
    words = precision_recall_f1(["b", "a", "a"], ["b", "a", "b"], average=None)
    assert words.labels == ["a", "b"]
    assert words.precision == pytest.approx([1.0, 0.5])
    assert words.recall == pytest.approx([0.5, 1.0])
    assert words.support == [2, 1]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: precision_recall_f1([0, 1], [0]), ValueError, "pair up"),
        (lambda: precision_recall_f1([], []), ValueError, "no items"),
        (lambda: precision_recall_f1([0], [0], average="samples"), ValueError, "average"),
        (lambda: precision_recall_f1([0.5], [0.5]), TypeError, "not float"),
        (
            lambda: precision_recall_f1(torch.tensor([0.0]), torch.tensor([0.0])),
            ValueError,
            "y_true",
        ),
        (lambda: precision_recall_f1("ab", "ab"), TypeError, "y_true"),
        (lambda: precision_recall_f1([0], [0], labels=[0, 0]), ValueError, "repeats"),
        (lambda: precision_recall_f1([0, "a"], [0, "a"]), TypeError, "labels="),
        (lambda: precision_recall_f1([0], [0], zero_division="warn"), TypeError, "zero_division"),
    ],
)
def test_bad_calls(call, error, match):
    with pytest.raises(error, match=match):
        call()
