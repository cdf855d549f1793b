"""The training loop on its own: position bookkeeping, divergence, Ctrl-C between steps."""

import math
import os
import signal

import pytest
import torch

from attnkit.experiments import checkpoints
from attnkit.experiments.config import RunConfig
from attnkit.experiments.training import Interrupted, Position, Trainer, TrainingError
from attnkit.tasks.dates_task import DatesTask

TINY = {"n_train": 64, "n_test": 8, "batch_size": 32, "d_model": 8, "epochs": 2}


def _trainer(tmp_path, loss=None, **kw):
    config = RunConfig(**{**TINY, **kw}).resolved()
    torch.manual_seed(0)
    task = DatesTask(config)
    if loss is not None:
        task.loss = loss.__get__(task)
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    lines = []
    trainer = Trainer(
        config, task, model, optimizer, tmp_path, Position(), say=lines.append, progress=False
    )
    return trainer, lines


def test_position_moves_to_the_next_epoch():
    p = Position(epoch=1, step=3, loss_sum=2.5, history=[{"epoch": 1}])
    p.next_epoch()
    assert (p.epoch, p.step, p.loss_sum, p.history) == (2, 0, 0.0, [{"epoch": 1}])


def test_fit_checkpoints_every_epoch_and_reports_validation(tmp_path):
    trainer, lines = _trainer(tmp_path)
    history = trainer.fit()
    assert [h["epoch"] for h in history] == [1, 2]
    assert all("val_exact_match" in h for h in history)
    assert len(lines) == 2 and lines[1].startswith("epoch 2/2  loss ")
    state = checkpoints.load(tmp_path, trainer.model)
    assert (state["epoch"], state["step"]) == (2, 0)


def test_divergence_names_the_knobs_that_are_set(tmp_path):
    def nan_loss(self, model, index):
        return DatesTask.loss(self, model, index) * math.nan

    trainer, _ = _trainer(tmp_path, nan_loss)
    with pytest.raises(TrainingError, match=r"Try a smaller --lr$"):
        trainer.fit()
    trainer, _ = _trainer(tmp_path / "s", nan_loss, supervise_attention=1.0)
    with pytest.raises(TrainingError, match="--lr or --supervise-attention"):
        trainer.fit()


def test_ctrl_c_saves_the_position_between_steps(tmp_path):
    calls = []

    def loss(self, model, index):
        calls.append(1)
        if len(calls) == 3:  # epoch 2, step 1
            os.kill(os.getpid(), signal.SIGINT)
        return DatesTask.loss(self, model, index)

    trainer, _ = _trainer(tmp_path, loss)
    with pytest.raises(Interrupted, match="epoch 2, after step 1 of 2"):
        trainer.fit()
    state = checkpoints.load(tmp_path, trainer.model)
    assert (state["epoch"], state["step"]) == (1, 1) and len(state["history"]) == 1


class _Penalised(torch.nn.Module):
    """A part whose only gradient comes from its own penalty."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))

    def auxiliary_loss(self):
        return self.w.square()


def test_parts_own_penalties_join_the_loss(tmp_path):
    config = RunConfig(**TINY).resolved()
    torch.manual_seed(0)
    task = DatesTask(config)
    model = task.build_model()
    model.penalised = _Penalised()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    trainer = Trainer(
        config, task, model, optimizer, tmp_path, Position(), say=lambda s: None, progress=False
    )
    trainer.fit()
    # No task gradient reaches w: it moved only because its penalty was in the loss.
    assert model.penalised.w.item() < 1.0 - config.lr


def test_the_task_ends_each_epoch_after_validation_and_before_the_checkpoint(tmp_path):
    """Task.end_epoch sees the epoch number after the validation; its change to the model is in
    that epoch's checkpoint and its note on that epoch's line."""
    calls = []

    def end_epoch(self, model, epoch):
        calls.append(epoch)
        with torch.no_grad():
            next(model.parameters()).fill_(float(epoch))
        return f"schedule step {epoch}"

    trainer, lines = _trainer(tmp_path)
    trainer.task.end_epoch = end_epoch.__get__(trainer.task)
    trainer.fit()
    assert calls == [1, 2]
    assert lines[0].endswith("(schedule step 1)") and "validation:" in lines[0]
    fresh = trainer.task.build_model()
    checkpoints.load(tmp_path, fresh)
    assert (next(fresh.parameters()) == 2.0).all()
