"""Sigmoid alignment (Galassi IV-C, Kim et al.): each weight independently in [0, 1]."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput
from attnkit.alignments.streaming import Streaming, Tiles

__all__ = ["Sigmoid"]


@REGISTRY.register("sigmoid")
class Sigmoid(Streaming, Alignment):
    """a_l = σ(e_l); masked keys get 0. Weights do not sum to 1 (``normalized`` is False)."""

    normalized = False
    label = tx.AlignmentKind.SIGMOID

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        weights = torch.sigmoid(scores)
        if mask is None:
            return AlignOutput(weights)
        # where, not a product: a masked score may be NaN and must not reach the weights.
        return AlignOutput(torch.where(mask, weights, torch.zeros((), dtype=weights.dtype)))

    # ---- streaming protocol: every weight is independent, so no statistic ------------------

    def stream_statistic(self, tiles: Tiles) -> None:
        return None

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        return torch.sigmoid(e)

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return p * (1 - p), None
