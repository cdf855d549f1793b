"""The keys of a run configuration (``attnkit run``): their names, types and defaults.

A task states its defaults in these keys (:attr:`attnkit.tasks.base.Task.defaults`) and names
the ones its model does not read (:meth:`attnkit.tasks.base.Task.unused`); the runner's
:class:`attnkit.experiments.RunConfig` has exactly these keys and resolves them against the
task. They live here, beside the tasks, so that checking a task's defaults at registration
(:func:`attnkit.tasks.user.check_task_class`) needs nothing from the runner.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields

__all__ = ["RunKeys"]


@dataclass
class RunKeys:
    """The keys of a run configuration and their defaults; ``None``: the task's default
    (quick or full). :class:`attnkit.experiments.RunConfig` derives from it and resolves and
    validates the keys against the task."""

    task: str = "dates"
    score: str | None = None  # the task's default, else "additive"
    align: str | None = None  # the task's default, else "softmax"
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    quick: bool = False
    supervise_attention: float = 0.0
    d_model: int | None = None
    n_train: int | None = None
    n_test: int | None = None
    seq_len: int | None = None  # for tasks whose defaults give one (sequence-length tasks)
    attention: str = "default"  # the task's mechanism, for tasks with several (Task.attentions)
    position: str = "default"  # a position scheme, for tasks that take one (Task.takes_position)
    data: str | None = None  # the user's data file, for tasks that read one (Task.reads_data)
    # a pretrained encoder ("minilm", or a local transformers checkpoint folder) fine-tuned with
    # the attention swapped, for tasks that take one (Task.takes_pretrained)
    pretrained: str | None = None
    # the user's module that defines the task, "pkg.mod:Class=name" or "/abs/file.py:Class=name"
    # (attnkit run --task-module): imported before the task is looked up, so a resumed, explained
    # or reloaded run finds it again (attnkit.tasks.user)
    task_module: str | None = None
    # the user's modules imported before the run (attnkit run --import, each a dotted module or
    # an absolute .py path), e.g. ones that register a part for a built-in task: imported again
    # when the run is resumed, explained or reloaded
    imports: list | None = None
    # ranks that split each sequence (ring attention, Task.context_parallel); with torchrun the
    # world is data-parallel replicas × this; a resumed run may change it (the weights do not
    # depend on it)
    context_parallel: int = 1
    # the task's own settings, name -> value (Task.settings; attnkit run --set NAME=VALUE, a
    # [settings] table in a --config file); resolved: every setting of the task, or None for a
    # task without settings
    settings: dict | None = None
    # training (attnkit.experiments.schedule; docs/training.md): the validation metric whose
    # best epoch's weights are kept and evaluated (None: the last epoch's), the epochs without
    # improvement of it after which training stops (None: never), the learning-rate schedule
    # over the run's steps ("constant", "linear", "cosine") after a linear warm-up of
    # warmup_steps, and the largest gradient norm (0: no clipping)
    best_metric: str | None = None
    patience: int | None = None
    # the kernel every score x alignment part evaluates with (attnkit.kernels.available();
    # None: chosen per call), applied again when the run is resumed, explained or reloaded
    kernel: str | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    clip_norm: float = 5.0

    @classmethod
    def names(cls) -> list[str]:
        """The keys, in the order of the fields."""
        return [f.name for f in fields(cls)]

    @classmethod
    def types(cls) -> dict[str, tuple[type, ...]]:
        """Key -> the Python types its value may have (``NoneType`` where None is allowed)."""
        hints = typing.get_type_hints(cls)
        return {k: typing.get_args(t) or (t,) for k, t in hints.items()}
