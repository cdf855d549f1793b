"""Run configuration: validated before anything is written."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import attnkit as ak

__all__ = ["TASKS", "ConfigError", "RunConfig"]

TASKS = ("dates", "digits")
# What `attnkit run` can build from a name (alignments needing no more than the query size).
ALIGNMENTS = (
    "softmax",
    "sparsemax",
    "entmax15",
    "sigmoid",
    "hard",
    "local",
    "reinforced",
    "uniform",
)


class ConfigError(ValueError):
    """A bad run configuration; the CLI prints it as one line and exits with status 2."""


@dataclass
class RunConfig:
    task: str = "dates"
    score: str = "additive"
    align: str = "softmax"
    epochs: int | None = None  # None: the task's default
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    quick: bool = False
    supervise_attention: float = 0.0
    d_model: int = 64
    n_train: int | None = None
    n_test: int | None = None

    def resolved(self) -> RunConfig:
        """Fill task defaults (quick runs are small) and validate; raises ConfigError."""
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}; tasks: {', '.join(TASKS)}")
        if self.score not in ak.scores.available() or self.score == "location":
            usable = [s for s in ak.scores.available() if s != "location"]
            raise ConfigError(f"unknown score {self.score!r}; scores: {', '.join(usable)}")
        if self.align not in ALIGNMENTS:
            raise ConfigError(
                f"unknown alignment {self.align!r}; alignments: {', '.join(ALIGNMENTS)}"
            )
        defaults = {
            ("dates", False): (6, 12000, 1000),
            ("dates", True): (3, 2000, 300),
            ("digits", False): (10, 6000, 1000),
            ("digits", True): (4, 2400, 300),
        }[(self.task, self.quick)]
        out = RunConfig(**asdict(self))
        out.epochs = defaults[0] if self.epochs is None else self.epochs
        out.n_train = defaults[1] if self.n_train is None else self.n_train
        out.n_test = defaults[2] if self.n_test is None else self.n_test
        for name in ("epochs", "batch_size", "d_model", "n_train", "n_test"):
            value = getattr(out, name)
            if not isinstance(value, int) or value < (0 if name == "epochs" else 1):
                raise ConfigError(
                    f"{name} must be a {'non-negative' if name == 'epochs' else 'positive'} "
                    f"int, got {value!r}"
                )
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if self.supervise_attention < 0:
            raise ConfigError(f"supervise_attention must be >= 0, got {self.supervise_attention!r}")
        if self.supervise_attention > 0 and self.task != "dates":
            raise ConfigError(
                "supervise_attention needs gold alignments: only the dates task has them"
            )
        return out

    def run_name(self) -> str:
        return f"{self.task}-{self.score}-{self.align}-s{self.seed}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def check_writable(path: Path) -> None:
    """Raise ConfigError unless ``path`` can be created or written."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and (not probe.is_dir() or not os.access(probe, os.W_OK)):
        raise ConfigError(f"output directory {str(path)!r} is not writable ({str(probe)!r})")
