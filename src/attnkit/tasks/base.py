"""What a task for ``attnkit run`` provides, and the registry the runner finds tasks in.

A task registers its data, model builder, loss, metrics (with what each means and which way is
better), heatmaps and its own defaults for a full and a quick run. The runner only calls these
methods; it names no task.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit.registry import Registry

__all__ = ["REGISTRY", "Metric", "Task", "TaskRegistry", "Unused", "at_least", "setting"]

_SCALARS = (bool, int, float, str)


def setting(default: Any, help: str) -> Any:
    """A field of a task's settings dataclass (:attr:`Task.settings`): its default and one line
    saying what it sets, which ``attnkit run --help`` lists.

    Example::

        @dataclass(frozen=True)
        class Settings:
            num_pairs: int = setting(8, "key-value pairs in a sequence")
    """
    if not isinstance(help, str) or not help.strip():
        raise TypeError(f"help must be a non-empty str, got {help!r}")
    return dataclasses.field(default=default, metadata={"help": help})


def at_least(settings: Any, minimum: int, *names: str) -> None:
    """Refuse a setting of ``settings`` (a settings dataclass) below ``minimum``, naming it:
    the settings ``names`` (all of them when none are given); None (not set) passes."""
    for name in names or [f.name for f in dataclasses.fields(settings)]:
        value = getattr(settings, name)
        if value is not None and value < minimum:
            kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
            raise ValueError(f"setting {name} must be {kind}, got {value!r}")


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    """The types a setting's value may have, from its annotation (``int``, ``float | None``,
    ...); ``NoneType`` where None is allowed."""
    args = typing.get_args(annotation) or (annotation,)
    return tuple(a for a in args if isinstance(a, type))


def _type_names(allowed: tuple[type, ...]) -> str:
    return " or ".join("None" if t is type(None) else t.__name__ for t in allowed)


@dataclass(frozen=True)
class Metric:
    """How to read one metric: what it measures, and whether higher or lower is better
    (``better=None``: neither, it describes the model)."""

    description: str
    better: str | None = "higher"

    def __post_init__(self) -> None:
        if self.better not in ("higher", "lower", None):
            raise ValueError(f"better must be 'higher', 'lower' or None, got {self.better!r}")

    @property
    def reading(self) -> str:
        return f"{self.better} is better" if self.better else "descriptive"


@dataclass(frozen=True)
class Unused:
    """Why a run-configuration key does not reach the model: ``by`` is what makes it unused (a
    flag and its value, e.g. ``"--attention performer"``, or ``"task 'copy'"``), ``why`` says
    what the model does instead."""

    by: str
    why: str


class Task:
    """Base class of a task for ``attnkit run``.

    Class attributes, read before any data is made:

    - ``description``: one line for ``attnkit run --help``.
    - ``defaults``: ``{"full": {...}, "quick": {...}}``, values for the run-configuration keys
      left unset (epochs, batch_size, lr, d_model, n_train, n_test).
    - ``metrics``: metric name -> :class:`Metric`, in the order reports show them.
    - ``gold_alignment``: True when the task has gold attention, so that the loss can be
      supervised (``supervise_attention``). Derived, never declared: True exactly when the task
      implements :meth:`gold` (and then also :meth:`supervised_weights`); a class that declares a
      value contradicting its methods is refused when it is defined.
    - ``attentions``: the mechanisms the task can build, chosen by the run configuration's
      ``attention`` key (``"default"``: the task's own choice), e.g. for ``--compare
      attention=...``.
    - ``takes_position``: True when the run configuration's ``position`` key (a position
      scheme's registered name; ``"default"``: the task's own choice) is honoured; the task's
      ``validate`` checks the name.
    - ``reads_data``: True when the task reads the user's file named by the run configuration's
      ``data`` key (``--data``); :meth:`example_settings` then writes a small one for tests.
    - ``takes_pretrained``: True when the task fine-tunes the pretrained encoder named by the
      run configuration's ``pretrained`` key (``--pretrained``); its :meth:`run_defaults` may
      then give other defaults (a fine-tuning learning rate).
    - ``context_parallel``: True when the task's sequences can be split over processes (the run
      configuration's ``context_parallel`` key, ring attention): the model is built from
      :class:`attnkit.MultiHeadAttention` layers that :func:`attnkit.distributed.
      context_parallel` can turn into ring layers, the task implements
      :meth:`context_parallel_model` and :meth:`context_parallel_loss`, and its ``validate``
      refuses lengths that do not split.
    - ``settings``: None, or a frozen dataclass listing the task's own settings (sizes of its
      data, vocabularies, ...), each field with a default and one line of help
      (:func:`setting`). The run configuration's ``settings`` key (``attnkit run --set
      NAME=VALUE``, a ``[settings]`` table in a ``--config`` file) sets them by name;
      :meth:`resolve_settings` fills the defaults and refuses unknown names and values of the
      wrong type, and the dataclass's ``__post_init__`` refuses bad values, naming the setting.
      An instance holds the resolved dataclass as ``self.settings``.

    ``unused(config)`` names the keys the configured model does not read (e.g. ``score`` for a
    mechanism with its own weights): setting one of them is refused, and the resolved
    configuration records it as ``None``.

    Training: the runner calls :meth:`loss`, which is the task's :meth:`objective` plus, when the
    run supervises attention (``supervise_attention`` λ > 0), λ · KL(gold ‖ weights) computed by
    :meth:`supervision_loss` from :meth:`gold` and :meth:`supervised_weights` (a joint loss of
    the task's loss and an attention-weight loss, Brauwers & Frasincar Sec. 4.2; Galassi et al.
    Sec. V-A) — written once, here, for every task with gold attention. A task implements
    :meth:`objective`; a task without gold attention may instead override :meth:`loss` itself.

    An instance is made from a resolved run configuration and makes its data.
    """

    description: ClassVar[str] = ""
    defaults: ClassVar[dict[str, dict[str, Any]]] = {}
    metrics: ClassVar[dict[str, Metric]] = {}
    gold_alignment: ClassVar[bool] = False
    attentions: ClassVar[tuple[str, ...]] = ()
    takes_position: ClassVar[bool] = False
    reads_data: ClassVar[bool] = False
    takes_pretrained: ClassVar[bool] = False
    context_parallel: ClassVar[bool] = False
    settings: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_settings_class(cls)
        has_gold = cls.gold is not Task.gold
        declared = cls.__dict__.get("gold_alignment")
        if declared is not None and declared != has_gold:
            does = "implements" if has_gold else "does not implement"
            raise TypeError(
                f"task class {cls.__name__} declares gold_alignment = {declared!r} but "
                f"{does} gold(split, index); gold_alignment is derived from the methods: "
                "implement gold and supervised_weights for gold attention, and leave "
                "gold_alignment out"
            )
        if has_gold and cls.supervised_weights is Task.supervised_weights:
            raise TypeError(
                f"task class {cls.__name__} implements gold(split, index) but not "
                "supervised_weights(model, split, index): the weights the gold is compared with"
            )
        cls.gold_alignment = has_gold

    def __init__(self, config: Any) -> None:
        self.config = config
        self.settings = type(self).settings_of(config)

    @classmethod
    def setting_fields(cls) -> dict[str, tuple[tuple[type, ...], Any, str]]:
        """Setting name -> (the types its value may have, its default, its help line); empty
        for a task without settings."""
        if cls.settings is None:
            return {}
        hints = typing.get_type_hints(cls.settings)
        return {
            f.name: (_allowed_types(hints[f.name]), f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(cls.settings)
        }

    @classmethod
    def resolve_settings(cls, values: Mapping[str, Any] | None) -> Any:
        """The task's settings dataclass with ``values`` (name -> value) over its defaults;
        None for a task without settings (then ``values`` must be empty).

        Raises:
            ValueError: an unknown name (the message names the task and its settings), a value
                of the wrong type, or one the dataclass's ``__post_init__`` refuses.
        """
        values = {} if values is None else values
        if not isinstance(values, Mapping):
            raise TypeError(
                f"settings must be a table of name -> value, got {type(values).__name__}"
            )
        known = cls.setting_fields()
        task = getattr(cls, "registered_name", None) or cls.__name__
        for name in values:
            if name not in known:
                close = difflib.get_close_matches(str(name), list(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                offered = ", ".join(known) or "none"
                raise ValueError(
                    f"settings: task {task!r} has no setting {name!r}{hint} (its settings: "
                    f"{offered})"
                )
        if cls.settings is None:
            return None
        checked = {}
        for name, value in values.items():
            allowed = known[name][0]
            ok = isinstance(value, allowed) and not (
                isinstance(value, bool) and bool not in allowed
            )
            if float in allowed and isinstance(value, int) and not isinstance(value, bool):
                ok, value = True, float(value)
            if not ok:
                raise ValueError(
                    f"setting {name} of task {task!r} must be {_type_names(allowed)}, got "
                    f"{type(value).__name__} {value!r}"
                )
            checked[name] = value
        try:
            return cls.settings(**checked)
        except ValueError as err:
            raise ValueError(f"task {task!r}: {err}") from None

    @classmethod
    def settings_of(cls, config: Any) -> Any:
        """The resolved settings dataclass of a run configuration (its ``settings`` key; a
        configuration without one gets the defaults), or None for a task without settings."""
        return cls.resolve_settings(getattr(config, "settings", None))

    @classmethod
    def parse_setting(cls, name: str, text: str) -> Any:
        """A setting's value from command-line text, by the setting's type (``none`` for None
        where the setting allows it); ValueError naming the task and the setting otherwise."""
        known = cls.setting_fields()
        if name not in known:
            cls.resolve_settings({name: None})  # raises, naming the task's settings
        allowed = known[name][0]
        task = getattr(cls, "registered_name", None) or cls.__name__
        if type(None) in allowed and text.lower() in ("none", "null"):
            return None
        if bool in allowed:
            if text.lower() in ("true", "yes", "1"):
                return True
            if text.lower() in ("false", "no", "0"):
                return False
        else:
            for kind in (int, float, str):
                if kind in allowed:
                    try:
                        return kind(text)
                    except ValueError:
                        continue
        raise ValueError(
            f"setting {name} of task {task!r} must be {_type_names(allowed)}, got {text!r}"
        )

    @classmethod
    def settings_help(cls) -> list[str]:
        """One line per setting: ``name = default: help``."""
        return [
            f"{name} = {default!r}: {text}" if text else f"{name} = {default!r}"
            for name, (_, default, text) in cls.setting_fields().items()
        ]

    @classmethod
    def run_defaults(cls, config: Any) -> dict[str, Any]:
        """The values of the run-configuration keys that ``config`` leaves unset: ``defaults``'
        ``quick`` or ``full`` entry, by ``config.quick``."""
        return cls.defaults["quick" if config.quick else "full"]

    @classmethod
    def example_settings(cls, directory: Any) -> dict[str, Any]:
        """Configuration keys a small example run of this task needs beyond its defaults (e.g.
        a generated data file written into ``directory`` for a task that ``reads_data``)."""
        return {}

    @classmethod
    def validate(cls, config: Any) -> None:
        """Raise ValueError, naming the key, for a resolved configuration this task cannot
        honour (e.g. more examples than the task can make). Called before anything is made."""

    @classmethod
    def unused(cls, config: Any) -> dict[str, Unused]:
        """The run-configuration keys (``score``, ``align``, ...) that the model built for
        ``config`` does not read, each with the reason; none by default. Called with the task's
        defaults filled in."""
        return {}

    def build_model(self) -> nn.Module:
        """A freshly initialised model for this task and configuration."""
        raise NotImplementedError

    def n_train(self) -> int:
        """Number of training examples."""
        raise NotImplementedError

    def loss(self, model: nn.Module, index: Tensor) -> Tensor:
        """Mean training loss over the training examples at ``index``: :meth:`objective`, plus
        λ · :meth:`supervision_loss` when the run configuration's ``supervise_attention`` λ is
        positive (only for a task with gold attention: the run configuration refuses λ > 0
        otherwise)."""
        value = self.objective(model, index)
        weight = getattr(self.config, "supervise_attention", 0.0) or 0.0
        if weight > 0 and self.gold_alignment:
            value = value + weight * self.supervision_loss(model, index)
        return value

    def objective(self, model: nn.Module, index: Tensor) -> Tensor:
        """The task's own mean training loss over the training examples at ``index`` (without
        the attention supervision, which :meth:`loss` adds)."""
        raise NotImplementedError(
            f"task {type(self).__name__} implements neither objective nor loss"
        )

    def gold(self, split: str, index: Tensor) -> Tensor:
        """The gold attention of the examples at ``index`` of ``split`` (``"train"`` and the
        splits of :meth:`has_split`): boolean links or non-negative scores (each row is
        normalised to a distribution; a row without gold mass is not supervised), in the shape
        of :meth:`supervised_weights` or broadcastable to it (e.g. one row for every head).
        Implemented only by a task with gold attention."""
        raise NotImplementedError(f"task {type(self).__name__} has no gold attention")

    def supervised_weights(self, model: nn.Module, split: str, index: Tensor) -> Tensor:
        """The attention weights (…, T, N) that :meth:`gold` describes, of ``model`` on the
        examples at ``index`` of ``split``, with their graph (a loss on them trains the model):
        the layer, heads and rows the task supervises. Each row is a distribution over N."""
        raise NotImplementedError(f"task {type(self).__name__} has no gold attention")

    def supervision_loss(self, model: nn.Module, index: Tensor, split: str = "train") -> Tensor:
        """KL(gold ‖ weights), the mean over the rows with gold, of the examples at ``index``
        (:func:`attnkit.evaluation.supervised_attention_loss` of :meth:`supervised_weights` and
        :meth:`gold`)."""
        from attnkit.evaluation.supervision import supervised_attention_loss

        weights = self.supervised_weights(model, split, index)
        gold = self.gold(split, index).to(weights.device)
        try:
            gold = gold.expand_as(weights)
        except RuntimeError:
            raise ValueError(
                f"task {type(self).__name__}: gold of shape {tuple(gold.shape)} does not "
                f"broadcast to the supervised weights' shape {tuple(weights.shape)}"
            ) from None
        return supervised_attention_loss(weights, gold)

    @torch.no_grad()
    def gold_divergence(self, model: nn.Module, split: str, index: Tensor) -> float:
        """KL(gold ‖ weights) of ``model`` in eval mode on the examples at ``index`` of
        ``split``: how far its attention is from the gold."""
        model.eval()
        return float(self.supervision_loss(model, index, split))

    def context_parallel_model(self, model: nn.Module, group: Any) -> nn.Module:
        """The module that :meth:`context_parallel_loss` runs on each rank of the process group
        ``group`` (its ring): usually :func:`attnkit.distributed.context_parallel` of ``model``,
        sharing its parameters. Only for tasks with ``context_parallel = True``."""
        raise NotImplementedError(f"task {type(self).__name__} is not context-parallel")

    def context_parallel_loss(self, model: nn.Module, index: Tensor, group: Any) -> Tensor:
        """This rank's part of :meth:`loss` over the examples at ``index`` when every rank of
        ``group`` holds its part of each sequence: the parts summed over the group are the mean
        loss, and each depends on the rank's part of the model (every rank runs the backward
        pass, a turn of the ring). ``model`` is :meth:`context_parallel_model`'s."""
        raise NotImplementedError(f"task {type(self).__name__} is not context-parallel")

    def has_split(self, name: str) -> bool:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Metrics of ``model`` on one split (``validation`` after each epoch, ``test`` at the
        end)."""
        raise NotImplementedError

    def end_epoch(self, model: nn.Module, epoch: int) -> str | None:
        """Called on every process after epoch ``epoch`` (counted from 1) and its validation,
        before the checkpoint: a task's training schedule (e.g. linear start) changes the model
        here, keeping its state in the model's buffers so that a resumed run continues it.
        Returns a few words for the epoch's line, or None."""
        return None

    def final_metrics(self, model: nn.Module) -> dict[str, float]:
        """The held-out metrics reported at the end of a run."""
        return self.evaluate(model, "test")

    def report_tables(self, model: nn.Module) -> list[dict]:
        """Extra tables for the report of a finished run (e.g. a classifier's confusion matrix):
        dicts with ``title``, ``header`` (column names), ``rows`` (lists of cells) and an
        optional ``note``. None by default."""
        return []

    def predict(self, model: nn.Module, inputs: list[str]) -> list[dict[str, Any]]:
        """The model's output for new inputs (``attnkit predict``, :meth:`attnkit.experiments.
        reload.LoadedRun.predict`): one dict per input with ``input``, ``prediction`` (text)
        and what else the task gives (probabilities, attention). Tasks that read the user's
        data implement it."""
        raise NotImplementedError(
            f"task {type(self).__name__} does not predict on new inputs (tasks that do: text, "
            "seq2seq)"
        )

    def heatmaps(self, model: nn.Module, n: int = 4) -> list[dict]:
        """Held-out examples for the report: dicts with ``title``, ``weights`` (2-D), ``gold``
        (same shape, bool), and either ``image`` or ``x_labels``/``y_labels`` with
        ``x_title``/``y_title``."""
        raise NotImplementedError


def _check_settings_class(cls: type[Task]) -> None:
    """Refuse, when the task class is defined, a ``settings`` that is not a frozen dataclass
    whose every field has a default and a type of bool, int, float or str (or None)."""
    settings = cls.__dict__.get("settings")
    if settings is None:
        return
    who = f"task class {cls.__name__}"
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
        raise TypeError(f"{who}: settings must be a frozen dataclass or None, got {settings!r}")
    if not settings.__dataclass_params__.frozen:
        raise TypeError(f"{who}: settings {settings.__name__} must be frozen "
                        "(@dataclass(frozen=True))")  # fmt: skip
    try:
        hints = typing.get_type_hints(settings)
    except Exception as err:  # an annotation that does not evaluate
        raise TypeError(f"{who}: the annotations of {settings.__name__} do not resolve "
                        f"({err})") from None  # fmt: skip
    for f in dataclasses.fields(settings):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{who}: setting {f.name} of {settings.__name__} has no default")
        allowed = _allowed_types(hints[f.name])
        if not allowed or not all(t in (*_SCALARS, type(None)) for t in allowed):
            raise TypeError(
                f"{who}: setting {f.name} of {settings.__name__} must be annotated bool, int, "
                f"float or str (or X | None), got {hints[f.name]!r}"
            )


class TaskRegistry(Registry[Task]):
    """The task registry; it also offers the tasks that installed packages publish under the
    entry-point group ``attnkit.tasks`` (:mod:`attnkit.tasks.user`): their names are listed by
    :meth:`available`, and one is imported, checked and registered on the first :meth:`get` of
    its name. A broken one raises ValueError naming the entry point."""

    def available(self) -> list[str]:
        from attnkit.tasks.user import entry_point_names

        return sorted(set(super().available()) | set(entry_point_names()))

    def get(self, name: str) -> type[Task]:
        if isinstance(name, str) and name not in self._table:
            from attnkit.tasks.user import load_entry_point

            load_entry_point(name)
        return super().get(name)


REGISTRY: TaskRegistry = TaskRegistry("task")
