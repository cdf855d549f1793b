"""The one output family of the mechanisms (DESIGN 7): what every registered mechanism returns."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["MechanismOutput"]


@runtime_checkable
class MechanismOutput(Protocol):
    """What every mechanism returns: a typed (named) tuple of its own fields, with the
    representation and its named weights.

    Each mechanism keeps its own field names (e.g. ``CoAttentionOutput(c1, c2, weights1,
    weights2)``), so callers read what the survey calls each tensor; the family adds the two
    members that generic code (the contract suite, evaluation, models) reads.
    """

    @property
    def representation(self) -> Tensor:
        """The mechanism's output for the next layer, batch first."""
        ...

    def named_weights(self) -> dict[str, Tensor]:
        """Every attention distribution the mechanism computed, by name, batch first."""
        ...
