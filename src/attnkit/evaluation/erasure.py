"""Erasure (Serrano & Smith 2019, "Is attention interpretable?", Sec. 4-5): remove the items an
importance ranking puts first, one at a time, until the model's decision flips. A ranking that
explains the decision flips it after few removals; Serrano & Smith compare the ranking by
attention with gradient-based and random rankings.

Items are removed through the attention mask (``keep``), which for softmax attention is what
Serrano & Smith do: the item's weight set to zero and the rest renormalised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.evaluation.importance import check_inputs

__all__ = ["ErasureResult", "erasure", "random_order"]


@dataclass(frozen=True)
class ErasureResult:
    """Per example: ``removed`` (B,) items removed when the decision first flipped (the
    count of kept items when it never did), ``fraction`` = removed / kept items, ``flipped``
    (B,) whether it flipped before only one item was left."""

    removed: Tensor
    fraction: Tensor
    flipped: Tensor


def random_order(keep: Tensor, seed: int = 0) -> Tensor:
    """A random ranking (B, N) of the items, the baseline ordering of Serrano & Smith."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(keep.shape, generator=generator).to(keep.device)


@torch.no_grad()
def erasure(
    logits_fn: Callable[[Tensor, Tensor], Tensor],
    inputs: Tensor,
    keep: Tensor | None,
    order: Tensor,
) -> ErasureResult:
    """Remove items in decreasing ``order`` (B, N) until ``argmax logits_fn(inputs, keep)``
    changes from the decision on all items.

    Args:
        logits_fn: ``(inputs (B, N, d), keep (B, N) bool) -> logits (B, C)``.
        order: importance of each item (attention weights, a gradient measure,
            :func:`random_order`); higher is removed first, ties by position.
    """
    keep = check_inputs(inputs, keep)
    if not isinstance(order, Tensor) or order.shape != keep.shape:
        raise ValueError(
            f"order must be a Tensor (B, N) = {tuple(keep.shape)}, got "
            f"{tuple(order.shape) if isinstance(order, Tensor) else type(order).__name__}"
        )
    decision = _decide(logits_fn, inputs, keep)
    # rank 0 = removed first, among kept items
    score = torch.where(keep, order.double(), torch.tensor(-torch.inf, dtype=torch.float64))
    rank = torch.sort(score, dim=-1, descending=True, stable=True).indices.argsort(-1)
    kept = keep.sum(-1)
    removed = kept.clone()
    flipped = torch.zeros_like(kept, dtype=torch.bool)
    for k in range(1, keep.shape[1]):
        active = ~flipped & (k < kept)
        if not bool(active.any()):
            break
        now = _decide(logits_fn, inputs, keep & (rank >= k))
        flip = active & (now != decision)
        removed = torch.where(flip, torch.full_like(removed, k), removed)
        flipped = flipped | flip
    fraction = removed.double() / kept.clamp_min(1).double()
    return ErasureResult(removed, fraction, flipped)


def _decide(logits_fn: Callable[[Tensor, Tensor], Tensor], inputs: Tensor, keep: Tensor) -> Tensor:
    logits = logits_fn(inputs, keep)
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[0] != keep.shape[0]:
        raise ValueError(
            "logits_fn(inputs, keep) must return logits (B, C), got "
            f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}"
        )
    return logits.argmax(-1)
