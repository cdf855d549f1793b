"""The value every attention call returns."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["AttentionOutput"]


class AttentionOutput(NamedTuple):
    """Result of an attention call; fields that were not requested are None.

    Attributes:
        context: (B, …, M, d_v) — c = Σ_l a_l v_l (Brauwers eq. 4), one row per query.
        weights: (B, …, M, N), or (B, …, M, N, d_v) for multi-dimensional attention; only with
            ``need_weights=True``.
        scores: the scores e before alignment, same shape as ``weights``; only with
            ``need_weights=True``.
        log_prob: (B, …, M) [(B, …, M, d_v) multi-dimensional], log-probability of the sampled
            choice for stochastic alignments (hard, reinforced); None otherwise.
    """

    context: Tensor
    weights: Tensor | None = None
    scores: Tensor | None = None
    log_prob: Tensor | None = None
