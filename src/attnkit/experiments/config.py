"""Run configuration: validated, with every error named, before anything is written."""

from __future__ import annotations

import difflib
import json
import math
import os
import typing
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from attnkit import tasks
from attnkit.tasks import parts

__all__ = ["ConfigError", "RunConfig", "check_output_dir", "parse_value"]

MAX_SEED = 2**32


class ConfigError(ValueError):
    """A bad run configuration; the CLI prints it as one line and exits with status 2."""


@dataclass
class RunConfig:
    """Everything that decides a run's results. ``None``: the task's default (quick or full)."""

    task: str = "dates"
    score: str | None = None  # the task's default, else "additive"
    align: str = "softmax"
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

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def types(cls) -> dict[str, tuple[type, ...]]:
        """Key -> the Python types its value may have (``NoneType`` where None is allowed)."""
        hints = typing.get_type_hints(cls)
        return {k: typing.get_args(t) or (t,) for k, t in hints.items()}

    def resolved(self) -> RunConfig:
        """Fill the task's defaults and validate; raises ConfigError naming the key."""
        _check_types(asdict(self), "")
        try:
            task = tasks.get(self.task)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        defaults = task.defaults["quick" if self.quick else "full"]
        unset = [k for k in self.names() if getattr(self, k) is None and k in defaults]
        out = replace(self, **{k: defaults[k] for k in unset})
        if out.score is None:
            out = replace(out, score="additive")
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
            if key == "seq_len" and not takes_length:
                continue
            if getattr(out, key) is None:
                raise ConfigError(f"{key} is not set and task {self.task!r} gives no default")
        for name in ("epochs", "batch_size", "n_train", "n_test", "seq_len"):
            if getattr(out, name) is not None and getattr(out, name) < 1:
                raise ConfigError(f"{name} must be a positive int, got {getattr(out, name)!r}")
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
        if out.supervise_attention > 0 and not task.gold_alignment:
            raise ConfigError(
                f"supervise_attention needs gold alignments, which task {out.task!r} does not "
                f"have (tasks with them: {', '.join(_supervisable())})"
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
        try:  # build the attention once, small, so a bad name fails before anything is written
            parts.build_attention(out.score, out.align, 4, 4)
        except (ValueError, TypeError) as err:
            raise ConfigError(str(err).replace("Available:", "available:")) from None
        return out

    def run_name(self) -> str:
        return f"{self.task}-{self.score}-{self.align}-s{self.seed}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "config") -> RunConfig:
        """Parse a saved configuration; unknown keys and values of the wrong type are refused
        with a ConfigError naming ``source`` and the key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = [k for k in data if k not in cls.names()]
        if unknown:
            raise ConfigError(f"{source}: {_unknown_key(unknown[0])}")
        _check_types(data, f"{source}: ")
        return cls(**data)


def _supervisable() -> list[str]:
    return [name for name in tasks.available() if tasks.get(name).gold_alignment]


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
