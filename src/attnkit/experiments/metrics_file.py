"""A run's metrics: checked when a task computes them, and ``metrics.json`` (the held-out
metrics, written last by ``attnkit run``) validated when it is read back by ``attnkit explain``
and :func:`attnkit.experiments.reload.load_run`.

Every metric is a number. A task from outside attnkit (``--task-module``, an entry point) must
give finite numbers: a NaN or an infinity is refused, naming the metric, before it reaches
``metrics.json`` or the history of a checkpoint. (attnkit's own tasks may say NaN for a
descriptive metric that is undefined for a model, e.g. the entropy of weights that are not
probabilities.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attnkit.experiments import checkpoints
from attnkit.experiments.config import ConfigError
from attnkit.experiments.failures import TaskError

__all__ = ["FILE", "check", "read", "write"]

FILE = "metrics.json"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check(metrics: Any, task: str, task_class: type, what: str) -> None:
    """Refuse ``metrics`` (what task ``task`` computed, ``what`` says where, e.g.
    ``"evaluate('validation') at epoch 2"``) unless it maps names to numbers, finite ones for a
    task from outside attnkit; TaskError naming the task and the metric."""
    from attnkit.tasks.user import is_builtin

    who = f"task {task!r}: {what}"
    if not isinstance(metrics, Mapping):
        raise TaskError(f"{who} must give a dict of metric -> number, got {type(metrics).__name__}")
    for name, value in metrics.items():
        if not _is_number(value):
            raise TaskError(f"{who} gave metric {name!r} = {value!r:.60}, not a number")
        if not is_builtin(task_class) and not math.isfinite(value):
            raise TaskError(
                f"{who} gave metric {name!r} = {value}, not a finite number; fix the task "
                "(its evaluate or final_metrics)"
            )


def write(run_dir: Path, metrics: Mapping[str, float]) -> Path:
    """Write ``metrics`` to ``run_dir/metrics.json`` atomically; its path."""
    path = run_dir / FILE
    checkpoints.atomic_write(path, lambda p: p.write_text(json.dumps(dict(metrics), indent=2)))
    return path


def read(run_dir: Path) -> dict[str, float] | None:
    """The held-out metrics of the run in ``run_dir``; None when the run has not written them
    (it has not finished). ConfigError naming the file when it is not a JSON object of metric
    names and numbers."""
    path = run_dir / FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict) or not data:
        got = "an empty object" if data == {} else type(data).__name__
        raise ConfigError(
            f"{path}: not the held-out metrics of a run (expected a JSON object of metric "
            f"names and numbers, got {got})"
        )
    for name, value in data.items():
        if not _is_number(value):
            raise ConfigError(
                f"{path}: not the held-out metrics of a run (metric {name!r} is "
                f"{value!r:.60}, not a number)"
            )
    return data
