"""Uniform alignment: every attendable key gets the same weight. The baseline of the
uniform-weights ablation (Brauwers 4.1; Jain & Wallace)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput

__all__ = ["Uniform"]


@REGISTRY.register("uniform")
class Uniform(Alignment):
    """a_l = 1/|{keys the row may attend}|; ignores the scores (which get no gradient)."""

    label = tx.AlignmentKind.GLOBAL

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        scores = inputs.alignment_inputs(self, scores, mask)
        allowed = (
            torch.ones_like(scores) if mask is None else mask.expand_as(scores).to(scores.dtype)
        )
        count = allowed.sum(dim=-1, keepdim=True)
        weights = allowed / count.clamp_min(1)
        # Keep the graph connected (zero gradient) so callers can still backpropagate; the
        # scores' values never matter, not even a NaN at a masked (padding) key.
        return AlignOutput(weights + 0 * torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0))
