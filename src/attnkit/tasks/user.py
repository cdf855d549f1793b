"""Tasks from outside attnkit: a module named on the command line (``attnkit run --task-module
pkg.mod:ClassName`` or ``path/to/file.py:ClassName``), and tasks that installed packages publish
under the entry-point group ``attnkit.tasks``.

Such a task is a :class:`~attnkit.tasks.base.Task` subclass, registered like a built-in one and
held to the same contract before it trains:

- at registration, :func:`check_task_class` reads its class attributes (``CLASS_CHECKS``);
- before a new run, :func:`check_task_run` builds it on a tiny copy of the run's configuration
  and calls every method the runner calls (``RUN_CHECKS``).

A module spec is ``TARGET:ClassName`` with an optional ``=name``. ``TARGET`` is a dotted module
name (importable: installed, or on ``PYTHONPATH``) or a path to a ``.py`` file. The task is
registered under ``name`` if given, else the class attribute ``name`` if the class has one, else
the lowercased class name. :func:`load_task_module` returns the spec normalised (a file path made
absolute, the name written out), which is what a run's ``config.json`` records, so that a run can
be resumed, explained and reloaded from any directory.

``attnkit run --import MODULE`` (:func:`load_import`) imports a module of the user's own before
the run, e.g. one that registers a part for a built-in task; a run's ``config.json`` records it
(key ``imports``). A file named by ``--task-module`` or ``--import`` has its folder put first on
``sys.path``, so it can import the files beside it.

An entry point's name is the task's name and its value the class (``mytask = pkg.mod:MyTask``);
it is imported on the first lookup of that name (:meth:`attnkit.tasks.base.TaskRegistry.get`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.run_keys import RunKeys

__all__ = [
    "CHECKED",
    "CLASS_CHECKS",
    "ENTRY_POINT_GROUP",
    "RUN_CHECKS",
    "check_task_class",
    "check_task_run",
    "entry_point_names",
    "is_builtin",
    "load_entry_point",
    "load_import",
    "load_task_module",
    "parse_spec",
]

ENTRY_POINT_GROUP = "attnkit.tasks"
REQUIRED_DEFAULTS = ("epochs", "batch_size", "lr", "d_model", "n_train", "n_test")
METHODS = ("build_model", "n_train", "has_split", "evaluate", "heatmaps")
CLASS_CHECKS = (
    "a Task subclass",
    "description: a non-empty str",
    "defaults: exactly 'full' and 'quick', each a dict of run-configuration keys giving "
    + ", ".join(REQUIRED_DEFAULTS),
    "metrics: a non-empty dict of str -> Metric",
    "gold_alignment, takes_position, reads_data, context_parallel: bools; attentions: strs",
    "settings: None, or a frozen dataclass whose fields (bool, int, float or str, or X | None) "
    "all have defaults that its checks accept",
    "defines " + ", ".join(METHODS) + ", and objective (or loss)",
    "with gold attention (gold overridden): defines supervised_weights and objective, not loss "
    "(Task.loss adds the supervision to objective)",
)
RUN_CHECKS = (
    "build_model on the run's configuration with n_train 4, n_test 4, batch_size 2",
    "n_train() is 4",
    "loss of 2 examples: a finite scalar that backpropagates",
    "with gold attention: gold('train', index) broadcasts to supervised_weights of 2 examples, "
    "and KL(gold ‖ weights) is finite and backpropagates",
    "has_split('validation') and has_split('test')",
    "evaluate('validation'): finite numbers named by metrics",
    "final_metrics: a finite number for every metric",
    "heatmaps(model, n=1): dicts with title, a 2-D weights and a gold of its shape",
)
CHECKED = (
    "class attributes (description, defaults full/quick, metrics, flags, settings, methods) "
    "and a tiny "
    "run (build_model, n_train, loss and its gradient, has_split, evaluate, final_metrics, "
    "heatmaps; n_train 4, n_test 4)"
)
TINY = {"n_train": 4, "n_test": 4, "batch_size": 2, "epochs": 1}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

_modules: dict[Path, Any] = {}  # file -> module made from it (a file is executed once)
_entry_points_seen: tuple[Any, Any] | None = None  # (entry_points function, its answer)


def is_builtin(cls: type) -> bool:
    """Whether ``cls`` is one of attnkit's own tasks (its contract is checked by attnkit's
    tests, so a run does not check it again)."""
    return cls.__module__.startswith("attnkit.")


def parse_spec(spec: str) -> tuple[str, str, str | None]:
    """``TARGET:ClassName[=name]`` -> (target, class name, name or None); ValueError naming
    ``--task-module`` and the expected form otherwise."""
    if not isinstance(spec, str):
        raise TypeError(f"--task-module must be a str, got {type(spec).__name__}")
    target, sep, rest = spec.rpartition(":")
    class_name, _, name = rest.partition("=")
    if not sep or not target or not class_name.isidentifier():
        raise ValueError(
            f"--task-module must be MODULE:CLASS or FILE.py:CLASS (optionally =NAME), got {spec!r}"
        )
    if name and not _NAME.fullmatch(name):
        raise ValueError(
            f"--task-module {spec!r}: task name {name!r} must be letters, digits, '_', '.' or "
            "'-', starting with a letter or digit"
        )
    return target, class_name, name or None


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(path: Path, source: str) -> Any:
    """The module made from the file ``path`` (executed once per process), its folder first on
    ``sys.path`` so that it can import the files beside it; ValueError starting with
    ``source`` (the flag and its value) when it cannot be imported."""
    if path in _modules:
        return _modules[path]
    if not path.is_file():
        raise ValueError(f"{source}: no such file {str(path)!r}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"attnkit_user_task_{stem}_{digest}"
    found = importlib.util.spec_from_file_location(module_name, path)
    if found is None or found.loader is None:
        raise ValueError(f"{source}: {str(path)!r} cannot be imported as Python")
    folder = str(path.parent)
    if folder not in sys.path:  # as Python does for a script: its siblings are importable
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(found)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        found.loader.exec_module(module)
    except BaseException as err:
        sys.modules.pop(module_name, None)
        if isinstance(err, KeyboardInterrupt | SystemExit):
            raise
        raise ValueError(
            f"{source}: importing {str(path)!r} failed: {type(err).__name__}: {err}"
        ) from err
    _modules[path] = module
    return module


def _import_module(target: str, source: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name is not None and target.startswith(err.name.split(".")[0]):
            form = "path/to/file.py:CLASS" if source.startswith("--task-module") else "a .py file"
            raise ValueError(
                f"{source}: no module named {err.name!r} (a module must be importable: "
                f"installed or on PYTHONPATH; or give the file, {form})"
            ) from None
        raise ValueError(
            f"{source}: importing {target!r} failed: {type(err).__name__}: {err}"
        ) from err
    except Exception as err:
        raise ValueError(
            f"{source}: importing {target!r} failed: {type(err).__name__}: {err}"
        ) from err


def load_import(spec: str) -> str:
    """Import the user's module named by ``spec`` (``attnkit run --import``): a dotted module
    name (installed or on ``PYTHONPATH``) or a path to a ``.py`` file (its folder put first on
    ``sys.path``), typically one that registers a part, a score or an alignment that a built-in
    task then builds by name. A file is executed once per process.

    Returns:
        the spec normalised, as ``config.json`` records it: a file path made absolute.

    Raises:
        ValueError: naming ``--import`` and the spec, when it cannot be imported.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--import must be a module name or a .py file, got {spec!r}")
    source = f"--import {spec!r}"
    if _is_file(spec):
        path = Path(spec).expanduser().resolve()
        _import_file(path, source)
        return str(path)
    if not all(part.isidentifier() for part in spec.split(".")):
        raise ValueError(f"{source}: not a dotted module name (pkg.module) nor a .py file")
    _import_module(spec, source)
    return spec


def _register(cls: type[Task], name: str, source: str) -> None:
    old = REGISTRY.snapshot().get(name)
    if old is not None and old is not cls and is_builtin(old):
        raise ValueError(
            f"{source}: task name {name!r} is taken by attnkit's {old.__qualname__}; give "
            "another name (MODULE:CLASS=NAME)"
        )
    try:
        REGISTRY.register(name)(cls)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def load_task_module(spec: str) -> tuple[str, str]:
    """Import the task class named by ``spec``, check its class-level contract and register it.

    Loading the same spec again registers the same class again (a file is executed once).

    Args:
        spec: ``pkg.mod:ClassName`` or ``path/to/file.py:ClassName``, optionally followed by
            ``=name``.

    Returns:
        (the registered task name, the spec normalised: the file path absolute, ``=name``
        written out).

    Raises:
        ValueError: a malformed spec, a module or file that cannot be imported, no such class,
            a class that breaks the contract (:func:`check_task_class`), or a name taken by
            another task. Each names ``--task-module`` and the spec.
    """
    target, class_name, name = parse_spec(spec)
    if _is_file(target):
        path = Path(target).expanduser().resolve()
        module, target = _import_file(path, f"--task-module {spec!r}"), str(path)
    else:
        module = _import_module(target, f"--task-module {spec!r}")
    cls = getattr(module, class_name, None)
    if cls is None:
        classes = sorted(
            k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Task)
        )
        raise ValueError(
            f"--task-module {spec!r}: {target!r} defines no {class_name!r} (its Task classes: "
            f"{', '.join(classes) or 'none'})"
        )
    source = f"--task-module {spec!r}"
    check_task_class(cls, source)
    if name is None:
        own = cls.__dict__.get("name")
        name = own if isinstance(own, str) else class_name.lower()
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{source}: task name {name!r} must be letters, digits, '_', '.' or '-'; give "
                "one with MODULE:CLASS=NAME"
            )
    _register(cls, name, source)
    return name, f"{target}:{class_name}={name}"


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_task_class(cls: Any, source: str) -> None:
    """Check what the runner reads from a task class before any data is made
    (``CLASS_CHECKS``); raise TypeError or ValueError starting with ``source``."""
    if not (isinstance(cls, type) and issubclass(cls, Task)) or cls is Task:
        got = cls.__qualname__ if isinstance(cls, type) else repr(cls)
        raise TypeError(f"{source}: expected a subclass of attnkit.tasks.Task, got {got}")
    who = f"{source}: task class {cls.__qualname__}"
    if not isinstance(cls.description, str) or not cls.description.strip():
        raise ValueError(f"{who}: description must be a non-empty str (one line for --help)")
    defaults = cls.defaults
    if not isinstance(defaults, Mapping) or set(defaults) != {"full", "quick"}:
        got = sorted(defaults) if isinstance(defaults, Mapping) else type(defaults).__name__
        raise ValueError(f"{who}: defaults must have exactly 'full' and 'quick', got {got}")
    keys = set(RunKeys.names())
    for mode, values in defaults.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"{who}: defaults[{mode!r}] must be a dict, got {values!r}")
        unknown = sorted(set(values) - keys)
        if unknown:
            raise ValueError(
                f"{who}: defaults[{mode!r}] has {unknown[0]!r}, not a run-configuration key "
                f"(keys: {', '.join(sorted(keys))})"
            )
        missing = [k for k in REQUIRED_DEFAULTS if k not in values]
        if missing:
            raise ValueError(f"{who}: defaults[{mode!r}] must give {', '.join(missing)}")
        for key in ("epochs", "batch_size", "d_model", "n_train", "n_test"):
            if not isinstance(values[key], int) or isinstance(values[key], bool):
                raise ValueError(
                    f"{who}: defaults[{mode!r}][{key!r}] must be an int, got {values[key]!r}"
                )
        if not _is_number(values["lr"]):
            raise ValueError(
                f"{who}: defaults[{mode!r}]['lr'] must be a number, got {values['lr']!r}"
            )
    metrics = cls.metrics
    if not isinstance(metrics, Mapping) or not metrics:
        raise ValueError(f"{who}: metrics must be a non-empty dict of name -> Metric")
    for key, metric in metrics.items():
        if not isinstance(key, str) or not isinstance(metric, Metric):
            raise ValueError(
                f"{who}: metrics must map names (str) to Metric, got {key!r}: {metric!r}"
            )
    for flag in ("gold_alignment", "takes_position", "reads_data", "context_parallel"):
        if not isinstance(getattr(cls, flag), bool):
            raise ValueError(f"{who}: {flag} must be a bool, got {getattr(cls, flag)!r}")
    attentions = cls.attentions
    if isinstance(attentions, str) or not isinstance(attentions, Iterable):
        raise ValueError(f"{who}: attentions must be a tuple of str, got {attentions!r}")
    if not all(isinstance(a, str) for a in attentions):
        raise ValueError(f"{who}: attentions must be a tuple of str, got {tuple(attentions)!r}")
    try:
        cls.resolve_settings({})  # the defaults pass the dataclass's own checks
    except (ValueError, TypeError) as err:
        raise ValueError(f"{who}: the defaults of its settings are refused: {err}") from None
    missing = [m for m in METHODS if getattr(cls, m) is getattr(Task, m)]
    if cls.objective is Task.objective and cls.loss is Task.loss:
        missing.append("objective")
    if missing:
        raise ValueError(f"{who}: must define {', '.join(missing)} (see attnkit.tasks.Task)")
    if cls.gold_alignment and (cls.objective is Task.objective or cls.loss is not Task.loss):
        raise ValueError(
            f"{who}: a task with gold attention (it defines gold) defines objective, its own "
            "loss, and leaves loss to attnkit.tasks.Task, which adds supervise_attention × "
            "KL(gold ‖ supervised_weights)"
        )


def check_task_run(cls: type[Task], config: Any) -> None:
    """Build the task on a tiny copy of the resolved run configuration ``config`` (``TINY``
    sizes) and call every method the runner calls (``RUN_CHECKS``); raise ValueError naming the
    task and what broke. The caller's random state is left as it was.

    When the task's ``validate`` refuses the tiny sizes, the run's own sizes are used.
    """
    who = f"task {config.task!r} ({cls.__module__}.{cls.__qualname__})"
    try:
        tiny = replace(config, **TINY).resolved()
    except ValueError:
        tiny = config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        try:
            _exercise(cls, tiny, who)
        except ValueError:
            raise
        except Exception as err:  # the user's code failing in any way is a contract breach
            raise ValueError(
                f"{who} failed the contract check: {type(err).__name__}: {err}"
            ) from err


def _exercise(cls: type[Task], config: Any, who: str) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"{who} failed the contract check: {what}")

    task = cls(config)
    model = task.build_model()
    if not isinstance(model, torch.nn.Module):
        fail(f"build_model must return a torch.nn.Module, got {type(model).__name__}")
    if task.n_train() != config.n_train:
        fail(f"n_train() is {task.n_train()!r}, the configuration's n_train is {config.n_train}")
    loss = task.loss(model, torch.arange(config.batch_size))
    if not isinstance(loss, torch.Tensor) or loss.shape != ():
        fail(f"loss must be a scalar tensor, got {loss!r:.80}")
    if not bool(torch.isfinite(loss)):
        fail(f"loss is {float(loss)} (not finite)")
    if not loss.requires_grad:
        fail("loss does not depend on the model's parameters (no gradient)")
    loss.backward()
    if cls.gold_alignment:
        index = torch.arange(config.batch_size)
        weights = task.supervised_weights(model, "train", index)
        gold = task.gold("train", index)
        for name, value in (("supervised_weights", weights), ("gold", gold)):
            if not isinstance(value, torch.Tensor):
                fail(f"{name} must return a tensor, got {type(value).__name__}")
        if weights.shape[0] != config.batch_size:
            fail(
                f"supervised_weights of {config.batch_size} examples has shape "
                f"{tuple(weights.shape)}: the first dimension must be the examples"
            )
        try:
            kl = task.supervision_loss(model, index)
        except (ValueError, TypeError) as err:
            fail(f"gold and supervised_weights do not fit: {err}")
        if not bool(torch.isfinite(kl)):
            fail(f"KL(gold ‖ supervised_weights) is {float(kl)} (not finite)")
        if not kl.requires_grad:
            fail("supervised_weights do not depend on the model's parameters (no gradient)")
    for split in ("validation", "test"):
        if not task.has_split(split):
            fail(f"has_split({split!r}) is False: the runner validates and tests on both")
    for what, found, exact in (
        ("evaluate('validation')", task.evaluate(model, "validation"), False),
        ("final_metrics", task.final_metrics(model), True),
    ):
        if not isinstance(found, Mapping):
            fail(f"{what} must return a dict, got {type(found).__name__}")
        extra = sorted(set(found) - set(cls.metrics))
        if extra:
            fail(f"{what} gives {extra[0]!r}, which metrics does not describe")
        if exact and set(found) != set(cls.metrics):
            fail(f"{what} lacks {sorted(set(cls.metrics) - set(found))[0]!r}")
        bad = [k for k, v in found.items() if not (_is_number(v) and math.isfinite(v))]
        if bad:
            fail(f"{what}[{bad[0]!r}] must be a finite number, got {found[bad[0]]!r}")
    maps = task.heatmaps(model, n=1)
    if not isinstance(maps, list) or not maps:
        fail("heatmaps(model, n=1) must return a non-empty list of dicts")
    for item in maps:
        if not isinstance(item, Mapping) or not item.get("title"):
            fail("each heatmap must be a dict with a title")
        weights = torch.as_tensor(item.get("weights"))
        if weights.ndim != 2:
            fail(f"heatmap {item['title']!r}: weights must be 2-D, got {tuple(weights.shape)}")
        if tuple(torch.as_tensor(item.get("gold")).shape) != tuple(weights.shape):
            fail(f"heatmap {item['title']!r}: gold must have the weights' shape")


def _entry_points() -> list[Any]:
    """The installed entry points of the group (read once per process, unless the lookup
    function changes)."""
    global _entry_points_seen
    find = importlib.metadata.entry_points
    if _entry_points_seen is None or _entry_points_seen[0] is not find:
        _entry_points_seen = (find, list(find(group=ENTRY_POINT_GROUP)))
    return _entry_points_seen[1]


def entry_point_names() -> list[str]:
    """Names of the tasks that installed packages publish under ``attnkit.tasks``."""
    return sorted({ep.name for ep in _entry_points()})


def load_entry_point(name: str) -> bool:
    """Import and register the task published under ``name``; False when no entry point has
    that name. ValueError naming the entry point (and its package) when it cannot be imported,
    is not a Task subclass or breaks the class-level contract."""
    found = [ep for ep in _entry_points() if ep.name == name]
    if not found:
        return False
    ep = found[0]
    dist = getattr(getattr(ep, "dist", None), "name", None)
    source = (
        f"task {name!r} from entry point '{ep.name} = {ep.value}' (group {ENTRY_POINT_GROUP}"
        + (f", package {dist}" if dist else "")
        + ")"
    )
    try:
        cls = ep.load()
    except Exception as err:
        raise ValueError(f"{source} cannot be loaded: {type(err).__name__}: {err}") from err
    try:
        check_task_class(cls, source)
    except TypeError as err:
        raise ValueError(str(err)) from None
    _register(cls, name, source)
    return True
