"""attnkit run --kernel: every score x alignment part of the run's model evaluates with the
named kernel (calls without weights), unknown names are refused when the config resolves."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.kernel_choice import apply_kernel


def test_every_score_alignment_part_of_a_task_model_gets_the_kernel(monkeypatch):
    config = RunConfig(task="dates", quick=True, kernel="dense").resolved()
    torch.manual_seed(0)
    task = tasks.get("dates")(config)
    model = task.build_model()
    assert apply_kernel(model, config.kernel) >= 1
    parts = [m for m in model.modules() if isinstance(m, ak.Attention)]
    assert parts and all(p.kernel == "dense" for p in parts)
    used = []
    dense = type(ak.kernels.get("dense"))
    attend = dense.attend
    monkeypatch.setattr(dense, "attend", lambda self, call: used.append(1) or attend(self, call))
    task.loss(model, torch.arange(4)).backward()
    assert used, "the dense kernel was not used in training"


def test_a_call_asking_for_weights_is_served_by_a_kernel_that_returns_them():
    part = ak.Attention(kernel="sdpa")  # SDPA returns no weights
    q = torch.randn(2, 5, 4)
    assert part(q, q, q).context.shape == (2, 5, 4)
    assert part(q, q, q, need_weights=True).weights.shape == (2, 5, 5)
    with pytest.raises(ValueError, match="kernel 'sdpa' cannot evaluate this call"):
        part(q, q, q, need_weights=True, kernel="sdpa")  # a call's own kernel is forced


def test_an_unknown_kernel_is_refused_when_the_config_resolves():
    with pytest.raises(ConfigError, match=r"kernel: unknown kernel 'fast'\. Available: "):
        RunConfig(task="dates", quick=True, kernel="fast").resolved()


def test_a_model_without_a_score_alignment_part_refuses_a_kernel():
    with pytest.raises(ConfigError, match="no score x alignment part"):
        apply_kernel(torch.nn.Linear(2, 2), "dense")
    assert apply_kernel(torch.nn.Linear(2, 2), None) == 0
