"""The learning-rate schedule of ``attnkit run``: a linear warm-up, then constant, linear or
cosine decay over the run's remaining steps.

The rate of a step is a function of the step's number alone (counted over the whole run from 0),
so a run resumed from a checkpoint, whose saved position gives the step, continues the schedule
exactly. With base rate η, ``warmup_steps`` W and T optimizer steps in the run (epochs × steps
per epoch), step s (0 ≤ s < T) trains with η · f(s):

- s < W: f(s) = (s + 1) / W (the first step already learns; step W − 1 reaches η);
- s ≥ W, with progress u = (s − W) / (T − W) in [0, 1):
  ``constant``: f = 1; ``linear``: f = 1 − u; ``cosine``: f = (1 + cos(π u)) / 2.

The last step's rate is above 0. Early stopping does not shorten T: the decay is planned over
the configured epochs.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_factor"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, total: int, *, warmup: int = 0, kind: str = "constant") -> float:
    """f(step): the share of the base learning rate at optimizer step ``step`` (0-based) of
    ``total`` steps, after ``warmup`` warm-up steps, for the schedule ``kind``.

    Raises:
        ValueError: an unknown ``kind``, ``total`` < 1, ``warmup`` < 0 or ``step`` outside
            [0, total).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if total < 1:
        raise ValueError(f"total must be a positive int, got {total!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not 0 <= step < total:
        raise ValueError(f"step must be in [0, {total}), got {step!r}")
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / (total - warmup)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
