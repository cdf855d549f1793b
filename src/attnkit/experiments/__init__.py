"""The experiment tool behind ``attnkit run``: configuration, training with checkpoints and
resume, evaluation of the attention, and the HTML report."""

from attnkit.experiments.config import ConfigError, RunConfig

__all__ = ["ConfigError", "RunConfig"]
