"""Reload a finished (or interrupted) ``attnkit run`` as a model, with its configuration and task.

    import attnkit as ak
    run = ak.load_run("runs/dates-additive-softmax-20261125-101500")
    run.model            # the trained model, in eval mode, weights of the newest checkpoint
                         # (of the best epoch for a run with best_metric)
    run.task.evaluate(run.model, "test")
    run.config, run.metrics, run.epoch, run.best_epoch
    run.predict(["a new input"])   # tasks that read your data: text, seq2seq

Loading has no side effects on the caller's process: the global random state is the same before
and after (the task's data is made under the run's seed inside a forked random state, and the
checkpoint's saved random state is not applied), and the thread count is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnkit import tasks
from attnkit.experiments import checkpoints, metrics_file
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.kernel_choice import apply_kernel
from attnkit.tasks.base import Task

__all__ = ["LoadedRun", "load_run"]


@dataclass(frozen=True)
class LoadedRun:
    """A run directory read back: the trained model and what produced it.

    Attributes:
        model: the task's model in eval mode, with the newest checkpoint's weights, or, for a
            run with ``best_metric``, those of its best epoch (the weights its held-out metrics
            and report are of).
        config: the run's configuration (``config.json``).
        task: the task object, with the data the run trained and evaluated on.
        metrics: the held-out metrics of ``metrics.json``; None for an unfinished run.
        epoch: the number of finished epochs in the checkpoint that was loaded.
        directory: the run directory.
        best_epoch: the epoch (from 1) whose weights ``model`` holds for a run with
            ``best_metric``; None otherwise.
    """

    model: nn.Module
    config: RunConfig
    task: Task
    metrics: dict | None
    epoch: int
    directory: Path
    best_epoch: int | None = None

    def predict(self, inputs: str | list[str]) -> list[dict[str, Any]]:
        """The model's output for new inputs (texts for the ``text`` task, source sentences for
        ``seq2seq``): one dict per input with ``input`` and ``prediction`` and what the task
        adds (``probabilities`` per label, ``attention`` weights, ...). A single string is one
        input.

        Raises:
            TypeError: ``inputs`` is not a string or a list of strings.
            ValueError: an empty list or an empty input.
            NotImplementedError: the run's task does not predict on new inputs.
        """
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list | tuple) or not all(isinstance(x, str) for x in inputs):
            raise TypeError(f"inputs must be a string or a list of strings, got {inputs!r:.80}")
        if not inputs:
            raise ValueError("inputs: expected at least one input, got an empty list")
        empty = [i for i, x in enumerate(inputs) if not x.strip()]
        if empty:
            raise ValueError(f"inputs: input {empty[0]} is empty; give text to predict on")
        self.model.eval()
        with torch.no_grad():
            return self.task.predict(self.model, list(inputs))


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
        apply_kernel(model, config.kernel)
        state = checkpoints.load(directory, model, restore_rng=False)
    if state is None:
        raise ConfigError(f"load_run: {str(directory)!r} has no checkpoint yet (nothing trained)")
    best = state.get("best")
    if best is not None:
        weights = checkpoints.load_best(directory)
        if weights is None:
            raise checkpoints.CheckpointError(
                f"damaged checkpoint: {checkpoints.latest(directory)}: its position names a "
                f"best epoch but it holds no {checkpoints.BEST}"
            )
        model.load_state_dict(weights)
    model.eval()
    return LoadedRun(
        model,
        config,
        task,
        metrics,
        int(state["epoch"]),
        directory,
        None if best is None else int(best["epoch"]),
    )
