"""Supervised attention (Brauwers 4.2; Galassi V-A): a loss pulling the weights towards gold
attention, added to the task loss with a factor λ."""

from __future__ import annotations

import torch
from torch import Tensor

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
    g = gold.to(weights.dtype)
    mass = g.sum(-1, keepdim=True)
    valid = mass.squeeze(-1) > 0
    if rows is not None:
        valid = valid & rows.bool()
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
