"""Every Table III model runs, learns in every parameter, and describe() gives its row."""

import pytest
import torch

from attnkit import taxonomy as tx
from attnkit.models import table3


def _members(model):
    return list(model.variants.values()) if isinstance(model, tx.Variants) else [model]


@pytest.mark.parametrize("name", list(table3.MODELS))
def test_describe_reproduces_the_survey_row(name):
    assert tx.describe(table3.build(name)).cells() == table3.SURVEY[name]


@pytest.mark.parametrize("name", list(table3.MODELS))
def test_model_runs_and_every_parameter_learns(name):
    for model in _members(table3.build(name)):
        torch.manual_seed(0)
        out = model.example()
        assert torch.isfinite(out).all()
        out.sum().backward()
        for pname, p in model.named_parameters():
            assert p.grad is not None, f"{pname} got no gradient"


def test_all_seventeen_rows():
    rows, marks = table3.reproduce()
    assert len(rows) == 17 and all(marks.values())


def test_a_changed_model_no_longer_matches():
    model = table3.build("Bahdanau et al. [3]")
    model.attention.module.align = __import__("attnkit").alignments.Sparsemax()
    assert tx.describe(model).alignment == "Sparse"
    assert tx.describe(model).cells() != table3.SURVEY["Bahdanau et al. [3]"]


def test_unknown_row():
    with pytest.raises(ValueError, match="unknown Table III row"):
        table3.build("Nobody et al.")
