"""Reinforced alignment (Shen et al.; Brauwers 3.2.2; Galassi IV-C)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax

__all__ = ["Reinforced"]


@REGISTRY.register("reinforced")
class Reinforced(Alignment):
    """A policy keeps each key with probability π_l = σ(s·e_l + b) (Bernoulli per key); soft
    attention (softmax) then runs over the kept keys only. s and b are learned scalars.

    In training mode the subset is sampled and ``log_prob`` (…, M) is Σ_l log P(z_l) over the
    keys the row may attend, for REINFORCE. In eval mode a key is kept when π_l > 1/2. The key
    with the highest score is always kept, so the context is never empty.
    """

    stochastic: ClassVar[bool] = True
    label = tx.Alignment.REINFORCED

    def __init__(self, *, scale: float = 1.0, bias: float = 0.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(scale)))
        self.bias = nn.Parameter(torch.tensor(float(bias)))

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        logits = self.scale.to(scores.dtype) * scores + self.bias.to(scores.dtype)
        if self.training:
            keep = torch.bernoulli(torch.sigmoid(logits.detach())).bool()
        else:
            keep = logits.detach() > 0
        valid = torch.ones_like(keep) if mask is None else mask.expand_as(keep)
        best = scores.detach().masked_fill(~valid, float("-inf")).argmax(dim=-1, keepdim=True)
        keep = keep.scatter(-1, best, True) & valid
        weights = masked_softmax(scores, keep)
        step = torch.where(keep, F.logsigmoid(logits), F.logsigmoid(-logits))
        log_prob = (step * valid).sum(dim=-1)
        return AlignOutput(weights, log_prob)
