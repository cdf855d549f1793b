"""Sigmoid alignment (Galassi IV-C, Kim et al.): each weight independently in [0, 1]."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput

__all__ = ["Sigmoid"]


@REGISTRY.register("sigmoid")
class Sigmoid(Alignment):
    """a_l = σ(e_l); masked keys get 0. Weights do not sum to 1 (``normalized`` is False)."""

    normalized = False
    label = tx.Alignment.SIGMOID
    streamable: ClassVar[bool] = True

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        weights = torch.sigmoid(scores)
        return AlignOutput(weights if mask is None else weights * mask)
