"""Reductions shared by several efficient per-head parts (LSH's hash rounds, Sinkhorn's
normalisation), kept apart from any one mechanism's file."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_logsumexp"]


def masked_logsumexp(x: Tensor, ok: Tensor, dim: int) -> Tensor:
    """log Σ exp over the entries where ``ok``; −inf (with finite gradients) where none is."""
    any_ok = ok.any(dim)
    safe = torch.where(ok, x, torch.finfo(x.dtype).min)
    lse = torch.logsumexp(torch.where(any_ok.unsqueeze(dim), safe, 0.0), dim)
    return torch.where(any_ok, lse, float("-inf"))
