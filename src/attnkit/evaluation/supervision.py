"""Supervised attention (Brauwers 4.2; Galassi V-A): a loss pulling the weights towards gold
attention, added to the task loss with a factor λ."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import checks

__all__ = ["supervised_attention_loss"]


def supervised_attention_loss(
    weights: Tensor, gold: Tensor, *, kind: str = "kl", rows: Tensor | None = None
) -> Tensor:
    """Distance between weights (…, T, N) and gold attention (…, T, N).

    ``gold`` may be boolean links or non-negative scores; each row is normalised to a
    distribution. Rows without gold mass (or excluded by ``rows``) do not count.

    - ``"kl"``: KL(gold ‖ weights) = Σ g (log g − log a).
    - ``"mse"``: mean squared error between the distributions.
    """
    weights = checks.floating(weights, "weights", "(…, T, N)")
    if not isinstance(gold, Tensor):
        raise TypeError(f"gold must be a torch.Tensor (…, T, N), got {type(gold).__name__}")
    checks.same_shape(("weights", weights), ("gold", gold))
    if gold.dtype != torch.bool:
        if not gold.is_floating_point():
            raise TypeError(
                f"gold must be boolean links or floating non-negative scores, got dtype "
                f"{gold.dtype}"
            )
        checks.nonnegative(gold, "gold", "scores")
    g = gold.to(weights.dtype)
    mass = g.sum(-1, keepdim=True)
    valid = mass.squeeze(-1) > 0
    if rows is not None:
        rows = checks.boolean_mask(
            rows, "rows", tuple(weights.shape[:-1]), meaning="True = a row that counts"
        )
        valid = valid & rows
    g = g / mass.clamp_min(torch.finfo(weights.dtype).tiny)
    if kind == "kl":
        eps = torch.finfo(weights.dtype).tiny
        per_row = (
            torch.where(
                g > 0,
                g * (g.clamp_min(eps).log() - weights.clamp_min(eps).log()),
                torch.zeros_like(g),
            )
        ).sum(-1)
    elif kind == "mse":
        per_row = ((weights - g) ** 2).mean(-1)
    else:
        raise ValueError(f"kind must be 'kl' or 'mse', got {kind!r}")
    if not bool(valid.any()):
        return weights.sum() * 0
    return per_row[valid].mean()
