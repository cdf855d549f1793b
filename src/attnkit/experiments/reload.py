"""Reload a finished (or interrupted) ``attnkit run`` as a model, with its configuration and task.

    import attnkit as ak
    run = ak.load_run("runs/dates-additive-softmax-20261125-101500")
    run.model            # the trained model, in eval mode, weights of the newest checkpoint
    run.task.evaluate(run.model, "test")
    run.config, run.metrics, run.epoch

Loading has no side effects on the caller's process: the global random state is the same before
and after (the task's data is made under the run's seed inside a forked random state, and the
checkpoint's saved random state is not applied), and the thread count is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from attnkit import tasks
from attnkit.experiments import checkpoints, metrics_file
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.base import Task

__all__ = ["LoadedRun", "load_run"]


@dataclass(frozen=True)
class LoadedRun:
    """A run directory read back: the trained model and what produced it.

    Attributes:
        model: the task's model with the newest checkpoint's weights, in eval mode.
        config: the run's configuration (``config.json``).
        task: the task object, with the data the run trained and evaluated on.
        metrics: the held-out metrics of ``metrics.json``; None for an unfinished run.
        epoch: the number of finished epochs in the checkpoint that was loaded.
        directory: the run directory.
    """

    model: nn.Module
    config: RunConfig
    task: Task
    metrics: dict | None
    epoch: int
    directory: Path


def load_run(run_dir: str | Path, *, require_finished: bool = False) -> LoadedRun:
    """Rebuild a run's model from its directory and load the newest checkpoint's weights.

    Args:
        run_dir: a directory written by ``attnkit run`` (holds ``config.json`` and
            ``checkpoints/``).
        require_finished: refuse a run that has no ``metrics.json`` (it stopped before its
            held-out evaluation) instead of loading its newest checkpoint.

    Returns:
        LoadedRun with the model in eval mode.

    Raises:
        ConfigError: not a run directory, or a damaged ``config.json`` / ``metrics.json``;
            a run with no checkpoint yet; an unfinished run with ``require_finished``.
        CheckpointError: a checkpoint file missing or damaged, its saved position edited, or
            ``config.json`` changed since the checkpoint was saved (each is under a checksum).
    """
    if not isinstance(run_dir, str | Path):
        raise TypeError(f"run_dir must be a path, got {type(run_dir).__name__}")
    directory = Path(run_dir)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"load_run: {str(directory)!r} is not a run directory (no config.json)")
    from attnkit.experiments.runner import load_config  # the runner imports this module's peers

    with torch.random.fork_rng(devices=[]):  # resolving builds a small part to check names
        config = load_config(directory).resolved()
    metrics = metrics_file.read(directory)
    if metrics is None and require_finished:
        raise ConfigError(
            f"load_run: {str(directory)!r} has no metrics.json: the run has not finished "
            "(continue it with attnkit run --resume, or pass require_finished=False)"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        task = tasks.get(config.task)(config)
        model = task.build_model()
        state = checkpoints.load(directory, model, restore_rng=False)
    if state is None:
        raise ConfigError(f"load_run: {str(directory)!r} has no checkpoint yet (nothing trained)")
    model.eval()
    return LoadedRun(model, config, task, metrics, int(state["epoch"]), directory)
