"""The training loop on its own: position bookkeeping, divergence, Ctrl-C between steps."""

import json
import math
import os
import signal
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from attnkit import tasks
from attnkit.experiments import checkpoints
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.training import Interrupted, Position, Trainer, TrainingError
from attnkit.tasks.base import Metric, Task
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


# ---- best epoch, early stopping, learning-rate schedule, gradient clipping -------------------

# The validation score of epochs 1, 2, ...: a tie at epoch 5 is no improvement.
SCRIPT = [0.2, 0.5, 0.4, 0.6, 0.6, 0.58, 0.59, 0.3, 0.9, 0.95]


class _Scripted(torch.nn.Module):
    """A linear regression whose buffer counts the finished epochs (set by the task)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.register_buffer("finished", torch.zeros((), dtype=torch.long))


class ScriptedTask(Task):
    """Trains a linear regression for real; its validation ``score`` (higher is better) and
    ``error`` (lower is better) follow ``SCRIPT`` by epoch, and the held-out metrics say which
    epoch's weights they were computed with (``trained_epochs``: the finished epochs then)."""

    description = "scripted validation metrics"
    sizes: ClassVar = {"epochs": 10, "n_train": 48, "n_test": 8, "batch_size": 8, "lr": 0.05}
    defaults: ClassVar = {"full": {**sizes, "d_model": 2}, "quick": {**sizes, "d_model": 2}}
    metrics: ClassVar = {
        "score": Metric("scripted"),
        "error": Metric("scripted", "lower"),
        "size": Metric("descriptive", None),
        "trained_epochs": Metric("epochs trained before the weights evaluated", None),
    }

    def __init__(self, config):
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        self.x = torch.randn(config.n_train, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(
            config.n_train, generator=g
        )
        self.scale = 1.0

    def build_model(self):
        return _Scripted()

    def n_train(self):
        return self.config.n_train

    def has_split(self, name):
        return name in ("validation", "test")

    def loss(self, model, index):
        predicted = model.linear(self.x[index]).squeeze(-1)
        return self.scale * (predicted - self.y[index]).square().mean()

    @torch.no_grad()
    def evaluate(self, model, split):
        done = int(model.finished)
        value = SCRIPT[min(done, len(SCRIPT) - 1)]
        return {"score": value, "error": 1 - value, "size": float(model.linear.weight.sum()),
                "trained_epochs": float(done)}  # fmt: skip

    def end_epoch(self, model, epoch):
        model.finished.fill_(epoch)

    def heatmaps(self, model, n=4):
        return []


def _expected_stop(values, patience, higher=True):
    """(best epoch, last epoch trained) by the early-stopping rule, written as a loop."""
    best, best_epoch, waited = None, 0, 0
    for epoch, v in enumerate(values, 1):
        if best is None or (v > best if higher else v < best):
            best, best_epoch, waited = v, epoch, 0
        else:
            waited += 1
        if patience is not None and waited >= patience:
            return best_epoch, epoch
    return best_epoch, len(values)


def _scripted(tmp_path, monkeypatch, **kw):
    monkeypatch.setitem(tasks.REGISTRY._table, "scripted", ScriptedTask)
    config = RunConfig(task="scripted", **kw).resolved()
    torch.manual_seed(0)
    task = ScriptedTask(config)
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    lines = []
    trainer = Trainer(
        config, task, model, optimizer, tmp_path, Position(), say=lines.append, progress=False
    )
    return trainer, lines


@pytest.mark.parametrize(
    ("metric", "patience"), [("score", 3), ("score", 2), ("error", 4), ("score", None)]
)
def test_early_stopping_stops_at_the_epoch_the_rule_gives(tmp_path, monkeypatch, metric, patience):
    trainer, lines = _scripted(tmp_path, monkeypatch, best_metric=metric, patience=patience)
    snapshots = {}
    end = ScriptedTask.end_epoch

    def end_epoch(self, model, epoch):
        snapshots[epoch] = {k: v.clone() for k, v in model.state_dict().items()}
        return end(self, model, epoch)

    trainer.task.end_epoch = end_epoch.__get__(trainer.task)
    history = trainer.fit()
    values = SCRIPT if metric == "score" else [1 - v for v in SCRIPT]
    best_epoch, last = _expected_stop(values, patience, higher=metric == "score")
    assert [h["epoch"] for h in history] == list(range(1, last + 1))
    p = trainer.position
    assert p.best == {"epoch": best_epoch, "value": values[best_epoch - 1]}
    assert p.stopped == (last < len(SCRIPT))
    assert any(line.startswith("early stopping") for line in lines) == p.stopped
    # the weights kept are those validated at the best epoch (before end_epoch's change)
    kept = trainer.best_weights
    for k, v in snapshots[best_epoch].items():
        assert torch.equal(kept[k], v), k
    state = checkpoints.load(tmp_path, trainer.task.build_model())
    assert state["best"] == p.best and state["stopped"] == p.stopped
    saved = checkpoints.load_best(tmp_path)
    assert all(torch.equal(saved[k], v) for k, v in kept.items())


def _lr_of_each_step(trainer):
    seen = []
    step = trainer.optimizer.step

    def recording(*a, **kw):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        return step(*a, **kw)

    trainer.optimizer.step = recording
    return seen


@pytest.mark.parametrize(("kind", "warmup"), [("cosine", 7), ("linear", 0), ("constant", 5)])
def test_each_step_trains_with_the_scheduled_rate(tmp_path, monkeypatch, kind, warmup):
    trainer, _ = _scripted(tmp_path, monkeypatch, epochs=3, schedule=kind, warmup_steps=warmup)
    seen = _lr_of_each_step(trainer)
    trainer.fit()
    total, base = 3 * 48 // 8, 0.05
    expected = []
    for s in range(total):  # the formula of docs/training.md, written out
        if s < warmup:
            f = (s + 1) / warmup
        elif kind == "constant":
            f = 1.0
        elif kind == "linear":
            f = 1 - (s - warmup) / (total - warmup)
        else:
            f = (1 + math.cos(math.pi * (s - warmup) / (total - warmup))) / 2
        expected.append(base * f)
    assert len(seen) == total
    assert seen == pytest.approx(expected, rel=1e-12, abs=0)
    assert [h["lr"] for h in trainer.position.history] == pytest.approx(expected[5::6])


def _grad_norms(trainer):
    norms = []
    step = trainer.optimizer.step

    def recording(*a, **kw):
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        return step(*a, **kw)

    trainer.optimizer.step = recording
    return norms


def test_clipping_bounds_the_gradient_norm_of_every_step(tmp_path, monkeypatch):
    trainer, _ = _scripted(tmp_path / "a", monkeypatch, epochs=1, lr=1e-4, clip_norm=0.5)
    trainer.task.scale = 100.0  # gradients far above the bound
    norms = _grad_norms(trainer)
    trainer.fit()
    assert max(norms) <= 0.5 * (1 + 1e-6) and min(norms) > 0.49
    free, _ = _scripted(tmp_path / "b", monkeypatch, epochs=1, lr=1e-4, clip_norm=0.0)
    free.task.scale = 100.0
    unclipped = _grad_norms(free)
    free.fit()
    assert min(unclipped) > 10  # without clipping the same steps are far above it


def test_training_options_refused_by_name(monkeypatch):
    monkeypatch.setitem(tasks.REGISTRY._table, "scripted", ScriptedTask)
    cases = {
        "schedule must be one of constant, linear, cosine": {"schedule": "step"},
        "warmup_steps must be an int >= 0": {"warmup_steps": -1},
        "clip_norm must be a finite number >= 0": {"clip_norm": -1.0},
        "patience 2 needs best_metric": {"patience": 2},
        "patience must be a positive int": {"patience": 0, "best_metric": "score"},
        "best_metric 'size': .* no better direction": {"best_metric": "size"},
        "best_metric 'acc': .* not one of its metrics; choose one of: score \\(higher": {
            "best_metric": "acc"
        },
    }
    for message, kw in cases.items():
        with pytest.raises(ConfigError, match=message):
            RunConfig(task="scripted", **kw).resolved()


class Killed(BaseException):
    """Stands for the process dying: nothing in the runner catches it."""


FULL = {"best_metric": "score", "patience": 3, "schedule": "cosine", "warmup_steps": 4,
        "clip_norm": 1.0}  # fmt: skip


def _run_scripted(out, resume=None):
    from attnkit.experiments.runner import run

    lines = []
    config = None if resume else RunConfig(task="scripted", **FULL)
    run_dir, metrics = run(config, out, resume=resume, progress=False, echo=lines.append, threads=1)
    return run_dir, metrics, lines


def test_held_out_metrics_report_and_load_run_use_the_best_epoch(tmp_path, monkeypatch):
    from attnkit.experiments.reload import load_run

    monkeypatch.setitem(tasks.REGISTRY._table, "scripted", ScriptedTask)
    run_dir, metrics, lines = _run_scripted(tmp_path / "run")
    best_epoch, last = _expected_stop(SCRIPT, 3)
    assert (best_epoch, last) == (4, 7)
    # the held-out metrics are of the weights validated at epoch 4: 3 epochs had ended then
    assert metrics["trained_epochs"] == best_epoch - 1
    assert "held-out evaluation with the weights of epoch 4 (best validation score 0.6000)" in lines
    page = (run_dir / "report.html").read_text()
    assert "With the weights of epoch 4 of 7, the best by validation score (0.6000)" in page
    loaded = load_run(run_dir)
    assert loaded.best_epoch == 4 and loaded.epoch == 7
    assert loaded.task.evaluate(loaded.model, "test") == metrics
    # resuming the finished run trains nothing more and evaluates the same weights
    _, again, said = _run_scripted(None, resume=run_dir)
    assert "training stopped early at epoch 7: evaluating" in said and again == metrics


@pytest.mark.parametrize("kill_at", [("save", 3), ("save", 9), ("step", 20), ("step", 33)])
def test_killed_mid_run_resumes_to_the_same_weights_and_metrics(tmp_path, monkeypatch, kill_at):
    """Killed inside a checkpoint's save or inside an epoch (between the saves), then resumed:
    the schedule, the best epoch, its weights and early stopping continue as if never killed."""
    monkeypatch.setitem(tasks.REGISTRY._table, "scripted", ScriptedTask)
    whole, metrics, _ = _run_scripted(tmp_path / "whole")
    where, n = kill_at
    calls = []

    def count(*_):
        calls.append(1)
        if len(calls) == n:
            raise Killed

    if where == "save":
        monkeypatch.setattr(checkpoints, "_written", count)
    else:
        loss = ScriptedTask.loss
        monkeypatch.setattr(ScriptedTask, "loss", lambda s, m, i: (count(), loss(s, m, i))[1])
    with pytest.raises(Killed):
        _run_scripted(tmp_path / "killed")
    monkeypatch.undo()
    monkeypatch.setitem(tasks.REGISTRY._table, "scripted", ScriptedTask)
    assert not (tmp_path / "killed" / "metrics.json").exists()
    _, resumed, _ = _run_scripted(None, resume=tmp_path / "killed")
    assert resumed == metrics
    for name in ("model.safetensors", checkpoints.BEST):
        a = load_file(str(checkpoints.latest(whole) / name))
        b = load_file(str(checkpoints.latest(tmp_path / "killed") / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    states = [
        json.loads((checkpoints.latest(d) / checkpoints.MANIFEST).read_text())["state"]
        for d in (whole, tmp_path / "killed")
    ]
    assert states[0] == states[1]


def test_an_edited_best_epoch_is_named_when_resumed(tmp_path, monkeypatch):
    monkeypatch.setitem(tasks.REGISTRY._table, "scripted", ScriptedTask)
    run_dir, _, _ = _run_scripted(tmp_path / "run")
    best = checkpoints.latest(run_dir) / checkpoints.BEST
    best.write_bytes(best.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(checkpoints.CheckpointError, match=r"best\.safetensors: contents differ"):
        _run_scripted(None, resume=run_dir)
