"""Masked pooling over the feature axis and single-query attention, shared by the
feature- and query-related mechanisms."""

from __future__ import annotations

from torch import Tensor

__all__ = ["attend_one", "key_mask", "masked_mean"]


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


def attend_one(att, q: Tensor | None, f: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """One query vector q (B, d_q) (or None for a query-free score) attends features f
    (B, n, d) as keys and values, with a (B, n) feature mask: context (B, d), weights (B, n)."""
    out = att(None if q is None else q.unsqueeze(-2), f, f, mask=key_mask(mask), need_weights=True)
    return out.context.squeeze(-2), out.weights.squeeze(-2)
