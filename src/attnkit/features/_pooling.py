"""Masked pooling over the feature axis, shared by the feature-related mechanisms."""

from __future__ import annotations

from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of x (B, n, d) over n, counting only positions where mask (B, n) is True.

    Rows with no valid position give 0.
    """
    if mask is None:
        return x.mean(dim=-2)
    m = mask.to(x.dtype).unsqueeze(-1)
    return (x * m).sum(dim=-2) / m.sum(dim=-2).clamp_min(1.0)


def key_mask(mask: Tensor | None) -> Tensor | None:
    """A (B, n) feature mask as an attention mask (B, 1, n) for a single query row."""
    return None if mask is None else mask.unsqueeze(-2)
