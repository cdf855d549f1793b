"""Training logs of ``attnkit run``: per-step and per-epoch CSV files, and TensorBoard events when
the ``tensorboard`` package is installed (``pip install attnkit[logs]``).

``steps.csv`` has one row per optimisation step (``epoch, step, global_step, loss, seconds``),
``epochs.csv`` one row per finished epoch (``epoch``, ``loss`` and the validation metrics,
``val_*``). Each row is flushed as it is written, so a killed run keeps its log up to its last
step. A resumed run first drops the rows after its checkpoint (those steps run again), so the
files of a resumed run equal those of a run that never stopped, except for the ``seconds`` column.
TensorBoard events go to ``tensorboard/`` (``tensorboard --logdir RUN_DIR/tensorboard``); they are
appended, so a resumed run shows the re-run steps twice there.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from attnkit.experiments.checkpoints import atomic_write

__all__ = ["RunLog", "tensorboard_available"]

STEP_FIELDS = ("epoch", "step", "global_step", "loss", "seconds")


def tensorboard_available() -> bool:
    """Whether TensorBoard event files can be written (the ``tensorboard`` package imports)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _kept_rows(path: Path, keep) -> tuple[list[str] | None, list[dict[str, str]]]:
    if not path.is_file():
        return None, []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = [row for row in reader if keep(row)]
        return reader.fieldnames, rows


class RunLog:
    """Appends training records to a run directory's logs (rank 0 only; others pass
    ``enabled=False``).

    Args:
        run_dir: the run directory.
        steps_per_epoch: steps in one epoch (for the global step number).
        epoch, step: the position training starts from (0, 0 for a new run); rows after it, left
            by a run that stopped after its last checkpoint, are dropped.
        enabled: write nothing when False.
        tensorboard: write TensorBoard events too when the package is installed (None: when
            installed; True: required, ImportError otherwise; False: never).
    """

    def __init__(
        self,
        run_dir: Path,
        steps_per_epoch: int,
        epoch: int = 0,
        step: int = 0,
        *,
        enabled: bool = True,
        tensorboard: bool | None = None,
    ) -> None:
        self.enabled, self.steps_per_epoch = enabled, steps_per_epoch
        self._start = time.perf_counter()
        self._writer = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.steps_path, self.epochs_path = run_dir / "steps.csv", run_dir / "epochs.csv"
        done = epoch * steps_per_epoch + step
        fields, rows = _kept_rows(self.steps_path, lambda r: int(r["global_step"]) <= done)
        self._rewrite(self.steps_path, list(STEP_FIELDS), rows)
        fields, rows = _kept_rows(self.epochs_path, lambda r: int(r["epoch"]) <= epoch)
        self._epoch_fields = fields
        if fields is not None:
            self._rewrite(self.epochs_path, fields, rows)
        if tensorboard is None:
            tensorboard = tensorboard_available()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=done + 1)

    @staticmethod
    def _rewrite(path: Path, fields: list[str], rows: list[dict[str, str]]) -> None:
        """Replace ``path`` by ``fields`` and ``rows`` in one step: a write that fails (a full
        disk) leaves the old log whole."""

        def write(tmp: Path) -> None:
            with tmp.open("w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)

        atomic_write(path, write)

    def step(self, epoch: int, step: int, loss: float) -> None:
        """Record finished step ``step`` (1-based) of epoch ``epoch`` (1-based)."""
        if not self.enabled:
            return
        global_step = (epoch - 1) * self.steps_per_epoch + step
        row = {
            "epoch": epoch,
            "step": step,
            "global_step": global_step,
            "loss": repr(float(loss)),
            "seconds": f"{time.perf_counter() - self._start:.3f}",
        }
        with self.steps_path.open("a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=STEP_FIELDS).writerow(row)
        if self._writer is not None:
            self._writer.add_scalar("train/loss", float(loss), global_step)

    def epoch(self, record: dict[str, Any]) -> None:
        """Record a finished epoch: ``record`` holds ``epoch``, ``loss`` and ``val_*`` metrics."""
        if not self.enabled:
            return
        fields = list(record)
        if self._epoch_fields is None:
            self._rewrite(self.epochs_path, fields, [])
            self._epoch_fields = fields
        row = {k: repr(float(v)) if isinstance(v, float) else v for k, v in record.items()}
        with self.epochs_path.open("a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, fieldnames=self._epoch_fields, extrasaction="ignore").writerow(row)
        if self._writer is not None:
            global_step = record["epoch"] * self.steps_per_epoch
            for key, value in record.items():
                if key != "epoch" and isinstance(value, int | float):
                    tag = f"validation/{key[4:]}" if key.startswith("val_") else f"epoch/{key}"
                    self._writer.add_scalar(tag, float(value), global_step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
