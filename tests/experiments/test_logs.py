"""Run logs: steps.csv and epochs.csv agree with the training history; rows after the checkpoint
are dropped on resume; TensorBoard events hold the same numbers."""

import csv

import pytest

from attnkit.experiments.config import RunConfig
from attnkit.experiments.logs import RunLog
from attnkit.experiments.runner import run

TINY = {"n_train": 96, "n_test": 16, "batch_size": 32, "d_model": 8, "epochs": 2}


def _rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir, _ = run(
        RunConfig(**TINY),
        tmp_path_factory.mktemp("logs") / "run",
        progress=False,
        echo=lambda line: None,
        threads=1,
    )
    return run_dir


def test_step_rows_average_to_each_epochs_loss(finished):
    steps, epochs = _rows(finished / "steps.csv"), _rows(finished / "epochs.csv")
    per_epoch = TINY["n_train"] // TINY["batch_size"]
    assert [int(r["global_step"]) for r in steps] == list(range(1, 2 * per_epoch + 1))
    assert [int(r["epoch"]) for r in epochs] == [1, 2]
    for e in epochs:
        losses = [float(r["loss"]) for r in steps if r["epoch"] == e["epoch"]]
        assert sum(losses) / len(losses) == pytest.approx(float(e["loss"]), rel=1e-12)
    assert any(key.startswith("val_") for key in epochs[0])


def test_rows_after_the_checkpoint_are_dropped_when_a_run_resumes(tmp_path):
    log = RunLog(tmp_path, steps_per_epoch=4, tensorboard=False)
    for step in range(1, 5):
        log.step(1, step, 1.0 / step)
    log.epoch({"epoch": 1, "loss": 0.5, "val_accuracy": 0.25})
    log.step(2, 1, 0.1)
    log.step(2, 2, 0.2)
    log.close()
    # the checkpoint holds epoch 1 and one step of epoch 2: the second step runs again
    log = RunLog(tmp_path, steps_per_epoch=4, epoch=1, step=1, tensorboard=False)
    assert [int(r["global_step"]) for r in _rows(tmp_path / "steps.csv")] == [1, 2, 3, 4, 5]
    log.step(2, 2, 0.3)
    assert float(_rows(tmp_path / "steps.csv")[-1]["loss"]) == 0.3
    assert [r["epoch"] for r in _rows(tmp_path / "epochs.csv")] == ["1"]
    # a checkpoint at the start of epoch 1 drops the epoch row too
    RunLog(tmp_path, steps_per_epoch=4, epoch=0, step=0, tensorboard=False)
    assert _rows(tmp_path / "epochs.csv") == [] and _rows(tmp_path / "steps.csv") == []


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional 'logs' extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, steps_per_epoch=2, tensorboard=True)
    log.step(1, 1, 0.75)
    log.step(1, 2, 0.25)
    log.epoch({"epoch": 1, "loss": 0.5, "val_accuracy": 0.625})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.75), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("validation/accuracy")] == [(2, 0.625)]


def test_disabled_logs_write_nothing(tmp_path):
    log = RunLog(tmp_path, steps_per_epoch=2, enabled=False)
    log.step(1, 1, 0.5)
    log.epoch({"epoch": 1, "loss": 0.5})
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_log_that_cannot_be_rewritten_keeps_the_old_rows(tmp_path, monkeypatch):
    """Resuming drops the rows after the checkpoint by rewriting the log; a disk that fills
    half-way through leaves the old file whole (nothing lost), not a truncated one."""
    import errno

    log = RunLog(tmp_path, steps_per_epoch=2, tensorboard=False)
    for step in (1, 2):
        log.step(1, step, 0.5)
    log.step(2, 1, 0.25)
    before = (tmp_path / "steps.csv").read_bytes()
    writerows = csv.DictWriter.writerows

    def full_disk(self, rows):
        writerows(self, list(rows)[:1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", full_disk)
    with pytest.raises(OSError, match="No space left"):
        RunLog(tmp_path, steps_per_epoch=2, epoch=1, step=0, tensorboard=False)
    assert (tmp_path / "steps.csv").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]
