"""The learning-rate schedule: warm-up, then constant, linear or cosine decay, by its formula."""

import math

import pytest
import torch

from attnkit.experiments.schedule import SCHEDULES, lr_factor


def test_linear_warmup_then_cosine_matches_torchs_cosine_annealing():
    """After the warm-up, the cosine factor is torch's CosineAnnealingLR (eta_min 0) over the
    T - W decay steps."""
    total, warmup = 30, 6
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup)
    theirs = []
    for _ in range(total - warmup):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        cosine.step()
    ours = [lr_factor(s, total, warmup=warmup, kind="cosine") for s in range(total)]
    assert ours[:warmup] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert ours[warmup:] == pytest.approx(theirs, abs=1e-12)


def test_linear_decays_to_one_step_above_zero_and_constant_stays():
    total = 10
    linear = [lr_factor(s, total, kind="linear") for s in range(total)]
    assert linear == pytest.approx([1 - s / total for s in range(total)])
    assert linear[-1] > 0
    assert [lr_factor(s, total, warmup=3) for s in range(total)] == [1 / 3, 2 / 3] + [1.0] * 8
    assert lr_factor(total - 1, total, kind="cosine") == pytest.approx(
        (1 + math.cos(math.pi * (total - 1) / total)) / 2
    )


def test_a_warmup_longer_than_the_run_only_warms_up():
    assert [lr_factor(s, 4, warmup=8, kind="cosine") for s in range(4)] == [0.125, 0.25, 0.375, 0.5]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"step": 0, "total": 5, "kind": "step"}, "kind must be one of"),
        ({"step": 0, "total": 0}, "total must be a positive int"),
        ({"step": 5, "total": 5}, r"step must be in \[0, 5\), got 5"),
        ({"step": 0, "total": 5, "warmup": -1}, "warmup must be an int >= 0"),
    ],
)
def test_bad_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        lr_factor(**kw)


def test_every_schedule_is_known():
    assert SCHEDULES == ("constant", "linear", "cosine")
