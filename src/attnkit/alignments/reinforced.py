"""Reinforced alignment (Shen et al.; Brauwers 3.2.2; Galassi IV-C)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, inputs
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

    ``scale`` and ``bias`` are the initial s and b (finite). A row whose attendable scores hold
    NaN gets NaN weights and a NaN ``log_prob`` (the policy is undefined there).
    """

    stochastic: ClassVar[bool] = True
    label = tx.AlignmentKind.REINFORCED

    def __init__(
        self,
        *,
        scale: float = 1.0,
        bias: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.scale = nn.Parameter(torch.tensor(arguments.finite_float(scale, "scale"), **kw))
        self.bias = nn.Parameter(torch.tensor(arguments.finite_float(bias, "bias"), **kw))

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        scores = inputs.alignment_inputs(self, scores, mask)
        logits = self.scale.to(scores.dtype) * scores + self.bias.to(scores.dtype)
        valid = torch.ones_like(scores, dtype=torch.bool)
        valid = valid if mask is None else valid & mask
        undefined = (scores.isnan() & valid).any(dim=-1)
        if self.training:
            # Sample on a defined probability; undefined rows are set to NaN below.
            keep = torch.bernoulli(torch.sigmoid(logits.detach()).nan_to_num(0.5)).bool()
        else:
            keep = logits.detach() > 0
        best = scores.detach().masked_fill(~valid, float("-inf")).argmax(dim=-1, keepdim=True)
        keep = keep.scatter(-1, best, True) & valid
        weights = masked_softmax(scores, keep)
        step = torch.where(keep, F.logsigmoid(logits), F.logsigmoid(-logits))
        log_prob = torch.where(valid, step, torch.zeros((), dtype=step.dtype)).sum(dim=-1)
        nan = torch.full((), float("nan"), dtype=weights.dtype)
        weights = torch.where(undefined.unsqueeze(-1), nan, weights)
        log_prob = torch.where(undefined, nan, log_prob)
        return AlignOutput(weights, log_prob)
