"""``attnkit run --kernel NAME``: the kernel every score × alignment part of a run's model
evaluates with (:class:`attnkit.Attention`'s ``kernel``), chosen by name as in the layers.

The kernel decides how the attention is computed, not what it computes, so it is not part of
the model's weights: a resumed, explained or reloaded run applies its configured kernel again
to the model its task builds.
"""

from __future__ import annotations

from torch import nn

from attnkit import kernels
from attnkit.core import Attention
from attnkit.experiments.config import ConfigError

__all__ = ["apply_kernel"]


def apply_kernel(model: nn.Module, name: str | None) -> int:
    """Set ``name`` as the kernel of every :class:`attnkit.Attention` in ``model``; returns how
    many there are. None leaves the automatic choice. Raises ConfigError when a kernel is
    named but the model has no score × alignment part to evaluate with it."""
    if name is None:
        return 0
    kernels.get(name)  # a name from a config: checked when it was resolved
    parts = [m for m in model.modules() if isinstance(m, Attention)]
    if not parts:
        raise ConfigError(
            f"kernel {name!r}: this model has no score x alignment part (attnkit.Attention) "
            "for a kernel to evaluate; leave --kernel out"
        )
    for part in parts:
        part.kernel = name
    return len(parts)
