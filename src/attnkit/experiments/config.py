"""Run configuration: validated, with every error named, before anything is written."""

from __future__ import annotations

import difflib
import json
import math
import os
import weakref
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from attnkit import alignments, kernels, tasks
from attnkit.tasks import parts
from attnkit.tasks.run_keys import RunKeys

__all__ = [
    "LIMITS",
    "ConfigError",
    "RunConfig",
    "check_output_dir",
    "parse_value",
    "supervision_support",
]

MAX_SEED = 2**32
# Upper bounds of the sizes: far above what any run on one machine finishes, so that a typo
# (epochs = 1e22 written as an int, a d_model of 10**9) is refused instead of training until
# killed or failing to allocate.
LIMITS = {
    "epochs": 100_000,
    "batch_size": 2**20,
    "n_train": 10**9,
    "n_test": 10**9,
    "seq_len": 2**20,
    "d_model": 2**16,
    "context_parallel": 2**12,
}


# id -> (weak reference, its fields) of the configurations resolved() returned
_RESOLVED: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


class ConfigError(ValueError):
    """A bad run configuration; the CLI prints it as one line and exits with status 2."""


@dataclass
class RunConfig(RunKeys):
    """Everything that decides a run's results: the keys of
    :class:`attnkit.tasks.run_keys.RunKeys` (``None``: the task's default, quick or full),
    resolved against the task and validated here.

    In a resolved configuration, ``score`` and ``align`` are ``None`` when the model does not
    read them (e.g. a mechanism with its own weights, :meth:`attnkit.tasks.base.Task.unused`);
    setting such a key is refused.
    """

    def resolved(self) -> RunConfig:
        """Fill the task's defaults and validate; raises ConfigError naming the key. A
        configuration this returned, unchanged since, is returned as it is (a run resolves its
        configuration once, however many steps ask)."""
        kept = _RESOLVED.get(id(self))
        if kept is not None and kept[0]() is self and kept[1] == asdict(self):
            return self
        out = self._resolve()
        key = id(out)
        ref = weakref.ref(out, lambda _, key=key: _RESOLVED.pop(key, None))
        _RESOLVED[key] = (ref, asdict(out))
        return out

    def _resolve(self) -> RunConfig:
        _check_types(asdict(self), "")
        _load_imports(self.imports)
        try:
            if self.task_module is not None:
                from attnkit.tasks.user import load_task_module

                name, _ = load_task_module(self.task_module)
                if name != self.task:
                    raise ConfigError(
                        f"task_module {self.task_module!r} registers task {name!r}, but the "
                        f"task is {self.task!r}; leave the task out or name {name!r}"
                    )
            task = tasks.get(self.task)
        except (ValueError, TypeError) as err:
            raise ConfigError(str(err)) from None
        defaults = task.run_defaults(self)
        unset = [k for k in self.names() if getattr(self, k) is None and k in defaults]
        out = replace(self, **{k: defaults[k] for k in unset})
        out = replace(out, settings=_resolve_settings(task, self.task, self.settings))
        out = replace(out, score=out.score or "additive", align=out.align or "softmax")
        takes_length = "seq_len" in defaults
        if out.seq_len is not None and not takes_length:
            with_length = [
                n for n in tasks.available() if "seq_len" in tasks.get(n).defaults["full"]
            ]
            raise ConfigError(
                f"seq_len: task {out.task!r} has no sequence length to set (tasks with one: "
                f"{', '.join(with_length)})"
            )
        for key in self.names():
            optional = (
                "data",
                "pretrained",
                "task_module",
                "imports",
                "settings",
                "best_metric",
                "patience",
                "kernel",
            )
            if (key == "seq_len" and not takes_length) or key in optional:
                continue  # data: checked by the tasks that read it
            if getattr(out, key) is None:
                raise ConfigError(f"{key} is not set and task {self.task!r} gives no default")
        for name in ("epochs", "batch_size", "n_train", "n_test", "seq_len"):
            if getattr(out, name) is not None and getattr(out, name) < 1:
                raise ConfigError(f"{name} must be a positive int, got {getattr(out, name)!r}")
        if out.kernel is not None:
            try:
                kernels.get(out.kernel)
            except (ValueError, TypeError) as err:
                raise ConfigError(f"kernel: {err}") from None
        if out.context_parallel < 1:
            raise ConfigError(
                f"context_parallel must be a positive int, got {out.context_parallel!r}"
            )
        for name, most in LIMITS.items():
            if getattr(out, name) is not None and getattr(out, name) > most:
                raise ConfigError(
                    f"{name} must be at most {most:_} (far above any run that finishes), got "
                    f"{getattr(out, name)!r}"
                )
        if out.context_parallel > 1 and not task.context_parallel:
            takers = [n for n in tasks.available() if tasks.get(n).context_parallel]
            raise ConfigError(
                f"context_parallel {out.context_parallel}: task {out.task!r} cannot split its "
                "sequences over processes (its model is not built from attention layers that "
                f"ring attention evaluates; tasks that can: {', '.join(takers) or 'none'})"
            )
        if out.d_model < 2 or out.d_model % 2:
            raise ConfigError(f"d_model must be an even int >= 2, got {out.d_model!r}")
        if not 0 <= out.seed < MAX_SEED:
            raise ConfigError(f"seed must be an int in [0, 2**32), got {out.seed!r}")
        if not (math.isfinite(out.lr) and out.lr > 0):
            raise ConfigError(f"lr must be a finite number > 0, got {out.lr!r}")
        if not (math.isfinite(out.supervise_attention) and out.supervise_attention >= 0):
            raise ConfigError(
                f"supervise_attention must be a finite number >= 0, got {out.supervise_attention!r}"
            )
        _check_training(out, task)
        if out.supervise_attention > 0 and not task.gold_alignment:
            raise ConfigError(
                f"supervise_attention needs gold alignments, which task {out.task!r} does not "
                f"have (tasks with them: {', '.join(_supervisable())})"
            )
        if out.supervise_attention > 0 and out.context_parallel > 1:
            raise ConfigError(
                f"supervise_attention {out.supervise_attention} with context_parallel "
                f"{out.context_parallel}: the supervised weights of a sequence split over "
                "processes are never gathered on one; supervise with context_parallel 1"
            )
        if out.batch_size > out.n_train:
            raise ConfigError(
                f"batch_size {out.batch_size} is larger than the training set (n_train = "
                f"{out.n_train}): no training step would run"
            )
        if out.attention != "default" and out.attention not in task.attentions:
            offered = ", ".join(task.attentions) or "none (only 'default')"
            raise ConfigError(
                f"attention {out.attention!r} is not offered by task {out.task!r}; it offers: "
                f"{offered}"
            )
        if out.position != "default" and not task.takes_position:
            takers = [n for n in tasks.available() if tasks.get(n).takes_position]
            raise ConfigError(
                f"position: task {out.task!r} takes no position scheme (tasks that do: "
                f"{', '.join(takers) or 'none'})"
            )
        try:
            task.validate(out)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        unused = task.unused(out)
        for key, reason in unused.items():
            if getattr(self, key) != _DEFAULTS[key]:  # set, not left to the default
                raise ConfigError(
                    f"{_flag(key)} {getattr(self, key)} contradicts {reason.by}: {reason.why}; "
                    f"leave {_flag(key)} out"
                )
        if out.pretrained is not None and not task.takes_pretrained:
            takers = [n for n in tasks.available() if tasks.get(n).takes_pretrained]
            raise ConfigError(
                f"pretrained: task {out.task!r} takes no pretrained model (tasks that do: "
                f"{', '.join(takers) or 'none'})"
            )
        if out.data is not None and not task.reads_data:
            readers = [n for n in tasks.available() if tasks.get(n).reads_data]
            raise ConfigError(
                f"data: task {out.task!r} reads no data file (tasks that do: "
                f"{', '.join(readers) or 'none'})"
            )
        # build the parts once, small, so a bad name fails before anything is written (in a
        # forked random state: resolving a configuration draws nothing from the caller's)
        try:
            with torch.random.fork_rng(devices=[]):
                if "score" not in unused:
                    parts.build_score(out.score, head_dim=4, max_len=4)
                if "align" not in unused:
                    parts.build_alignment(out.align, 4)
        except (ValueError, TypeError) as err:
            why = str(err)
            if why.startswith(("unknown score", "unknown alignment")):
                why += (
                    " (a score or alignment of your own is known once the module that registers "
                    "it is imported: attnkit run --import MODULE or --import path/to/file.py)"
                )
            raise ConfigError(why) from None
        if out.supervise_attention > 0 and "align" not in unused:
            why = _unsupervisable(out.align)
            if why:
                raise ConfigError(
                    f"--supervise-attention {out.supervise_attention} contradicts --align "
                    f"{out.align}: {why}"
                )
        # keys the model does not read are recorded as unset, never as values that were used
        return replace(out, **{k: None for k in ("score", "align", "d_model") if k in unused})

    def attention_name(self) -> str:
        """What computes the attention, in a few words: the mechanism (when not the task's
        default), then the score and the alignment where the model reads them."""
        named = [] if self.attention == "default" else [self.attention]
        return "-".join(named + [v for v in (self.score, self.align) if v is not None])

    def run_name(self) -> str:
        """``<task>-<attention>-s<seed>``, the attention named after what runs (of a resolved
        configuration: e.g. ``dates-additive-softmax-s0``, ``kv-recall-performer-s0``)."""
        return "-".join(p for p in (self.task, self.attention_name(), f"s{self.seed}") if p)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_file(cls, path: str | Path) -> dict[str, Any]:
        """The keys set in a configuration file (``attnkit run --config FILE``): TOML (``.toml``)
        or JSON (``.json``), the keys of ``config.json``; unknown keys and values of the wrong
        type are refused with a ConfigError naming the file and the key."""
        path = Path(path)
        if path.suffix.lower() not in (".toml", ".json"):
            raise ConfigError(f"--config {str(path)!r}: must end in .toml or .json")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--config {str(path)!r}: cannot be read ({err})") from None
        if path.suffix.lower() == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: not valid JSON ({err})") from None
        else:
            import tomllib

            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as err:
                raise ConfigError(f"{path}: not valid TOML ({err})") from None
        cls._from_mapping(data, str(path))  # checks every key and type
        return data

    @classmethod
    def from_json(cls, text: str, source: str = "config") -> RunConfig:
        """Parse a saved configuration; unknown keys and values of the wrong type are refused
        with a ConfigError naming ``source`` and the key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: not valid JSON ({err})") from None
        return cls._from_mapping(data, source)

    @classmethod
    def _from_mapping(cls, data: Any, source: str) -> RunConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = [k for k in data if k not in cls.names()]
        if unknown:
            raise ConfigError(f"{source}: {_unknown_key(unknown[0])}")
        _check_types(data, f"{source}: ")
        return cls(**data)


_DEFAULTS = {f.name: f.default for f in fields(RunConfig)}


def _resolve_settings(task: type, name: str, given: dict | None) -> dict | None:
    """Every setting of ``task`` (its defaults, ``given`` over them) as a dict, or None for a
    task without settings; ConfigError naming the setting otherwise."""
    if given and task.settings is None:
        having = [n for n in tasks.available() if _task_or_none(n) is not None
                  and _task_or_none(n).settings is not None]  # fmt: skip
        raise ConfigError(
            f"settings: task {name!r} has no settings to set (tasks with settings: "
            f"{', '.join(having) or 'none'})"
        )
    try:
        resolved = task.resolve_settings(given)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None
    return None if resolved is None else asdict(resolved)


def _check_training(config: RunConfig, task: type) -> None:
    """Refuse, naming the key, a schedule, warm-up, clipping norm, best metric or patience
    that the run cannot honour."""
    from attnkit.experiments.schedule import SCHEDULES

    if config.schedule not in SCHEDULES:
        raise ConfigError(
            f"schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}"
        )
    if config.warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an int >= 0, got {config.warmup_steps!r}")
    if not (math.isfinite(config.clip_norm) and config.clip_norm >= 0):
        raise ConfigError(
            f"clip_norm must be a finite number >= 0 (0: no clipping), got {config.clip_norm!r}"
        )
    if config.patience is not None and config.patience < 1:
        raise ConfigError(f"patience must be a positive int, got {config.patience!r}")
    if config.patience is not None and config.best_metric is None:
        raise ConfigError(
            f"patience {config.patience} needs best_metric: the validation metric whose "
            "improvement it waits for (e.g. --best-metric accuracy)"
        )
    if config.best_metric is None:
        return
    ranked = {k: m for k, m in task.metrics.items() if m.better is not None}
    if config.best_metric not in ranked:
        why = (
            "describes the model, with no better direction"
            if config.best_metric in task.metrics
            else "is not one of its metrics"
        )
        raise ConfigError(
            f"best_metric {config.best_metric!r}: for task {config.task!r} it {why}; choose one "
            f"of: {', '.join(f'{k} ({m.better} is better)' for k, m in ranked.items()) or 'none'}"
        )


def _load_imports(imports: list | None) -> None:
    """Import the user's modules of ``imports`` (:func:`attnkit.tasks.user.load_import`);
    ConfigError naming the one that fails."""
    if imports is None:
        return
    from attnkit.tasks.user import load_import

    for spec in imports:
        if not isinstance(spec, str):
            raise ConfigError(
                f"imports must be a list of module names or .py files, got {imports!r:.80}"
            )
        try:
            load_import(spec)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _task_or_none(name: str) -> type | None:
    try:
        return tasks.get(name)
    except (ValueError, TypeError):
        return None


def _flag(key: str) -> str:
    """The ``attnkit run`` flag that sets ``key``."""
    return "--" + key.replace("_", "-")


def _unsupervisable(align: str) -> str | None:
    """Why attention supervision (KL(gold ‖ weights) added to the loss) cannot train through
    the alignment ``align``, or None when it can: a stochastic alignment returns a sampled
    one-hot (no gradient reaches the scores through the sample, and the divergence is infinite
    wherever the sample misses the gold), and an alignment whose weights do not depend
    differentiably on the scores gives the term no gradient to follow."""
    import torch

    if alignments.REGISTRY.get(align).stochastic:
        return (
            f"alignment {align!r} samples one-hot weights: no gradient reaches the scores "
            "through the sample and KL(gold ‖ weights) is infinite wherever it misses the gold; "
            "supervise a deterministic alignment (e.g. softmax)"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        part = parts.build_alignment(align, 4)
        scores = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
        query = torch.randn(2, 3, 4, dtype=torch.float64)
        part = part.double().train()
        weights = part(scores, query=query).weights
        (grad,) = torch.autograd.grad(
            (weights * torch.randn_like(weights)).sum(), scores, allow_unused=True
        )
    if grad is None or not bool(grad.abs().sum() > 0):
        return (
            f"alignment {align!r} gives weights that do not depend differentiably on the "
            "scores: the supervision term has no gradient to train the attention with"
        )
    return None


def _supervisable() -> list[str]:
    return [name for name in tasks.available() if tasks.get(name).gold_alignment]


def supervision_support() -> dict[str, tuple[str, ...]]:
    """Task name -> the ``attention`` values (``"default"`` first) with which a quick run of it
    accepts ``supervise_attention``, for every task with gold attention (an empty tuple: the
    task has gold attention but refuses the supervision, e.g. ``sort``, whose attention is its
    output). Read from the registry by resolving each configuration."""
    out = {}
    for name in _supervisable():
        task = tasks.get(name)
        accepted = []
        for attention in ("default", *task.attentions):
            config = RunConfig(task=name, attention=attention, quick=True, supervise_attention=1.0)
            try:
                config.resolved()
            except ConfigError:
                continue
            accepted.append(attention)
        out[name] = tuple(accepted)
    return out


def _unknown_key(key: str) -> str:
    close = difflib.get_close_matches(key, RunConfig.names(), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key {key!r}{hint} (keys: {', '.join(RunConfig.names())})"


def _check_types(data: dict[str, Any], prefix: str) -> None:
    types = RunConfig.types()
    for key, value in data.items():
        allowed = types[key]
        ok = isinstance(value, allowed)
        if isinstance(value, bool) and bool not in allowed:
            ok = False  # a bool is an int in Python, but not a count or a seed
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(
                f"{prefix}{key} must be {names}, got {type(value).__name__} {value!r}"
            )


def parse_value(key: str, text: str) -> Any:
    """A configuration value from command-line text, by the key's type."""
    if key not in RunConfig.names():
        raise ConfigError(_unknown_key(key))
    if key == "settings":
        raise ConfigError(
            "settings are set one by one: --set NAME=VALUE, or --compare set.NAME=V1,V2,..."
        )
    allowed = RunConfig.types()[key]
    if bool in allowed:
        if text.lower() in ("true", "yes", "1"):
            return True
        if text.lower() in ("false", "no", "0"):
            return False
        raise ConfigError(f"{key} must be true or false, got {text!r}")
    for kind in (int, float, str):
        if kind in allowed:
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"{key} must be {kind.__name__}, got {text!r}") from None
    raise ConfigError(f"{key}: cannot parse {text!r}")


def check_output_dir(path: Path) -> None:
    """Raise ConfigError unless ``path`` can become a new run directory: it must not exist, or
    be an empty directory, and be creatable."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"output directory {str(path)!r} exists and is not a directory")
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            raise ConfigError(
                f"output directory {str(path)!r} is not empty (holds {entries[0]!r}"
                f"{f' and {len(entries) - 1} more' if len(entries) > 1 else ''}); choose a new "
                f"--out, or continue a run there with --resume {str(path)!r}"
            )
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"output directory {str(path)!r} is not writable ({str(probe)!r})")
