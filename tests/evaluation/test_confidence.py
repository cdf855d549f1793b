"""Attention confidence by hand; AUROC against scikit-learn, point-biserial against scipy."""

import math

import pytest
import torch
from scipy.stats import pointbiserialr
from sklearn.metrics import roc_auc_score

from attnkit.evaluation.confidence import attention_confidence, confidence_correlation


def test_attention_confidence_by_hand():
    out = attention_confidence(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    assert out["max_weight"].tolist() == [1.0, 0.5]
    assert out["neg_entropy"].tolist() == pytest.approx([0.0, -math.log(2)])


def test_correlation_against_references_with_ties():
    g = torch.Generator().manual_seed(0)
    conf = torch.randint(0, 5, (40,), generator=g).double()
    correct = torch.rand(40, generator=g) < 0.6
    got = confidence_correlation(conf, correct)
    assert got["auroc"] == pytest.approx(roc_auc_score(correct.numpy(), conf.numpy()))
    ref = pointbiserialr(correct.numpy(), conf.numpy()).statistic
    assert got["point_biserial"] == pytest.approx(ref)


def test_undefined_and_errors():
    got = confidence_correlation(torch.rand(3), torch.ones(3, dtype=torch.bool))
    assert math.isnan(got["auroc"]) and math.isnan(got["point_biserial"])
    with pytest.raises(ValueError, match="confidence"):
        confidence_correlation(torch.rand(3), torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="correct"):
        confidence_correlation(torch.rand(3), torch.ones(3))
