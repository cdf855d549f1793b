"""Soft / global alignment (Brauwers eq. 25) with fixed or learned temperature (Galassi IV-C)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax

__all__ = ["Softmax"]


@REGISTRY.register("softmax")
class Softmax(Alignment):
    """a_l = exp(e_l/τ) / Σ_j exp(e_j/τ) (Brauwers eq. 25; τ = 1 by default).

    Args:
        temperature: τ > 0. Higher is smoother.
        learnable: learn τ (Lin et al.'s adaptive temperature, Galassi IV-C); it is kept
            positive by learning log τ.
    """

    streamable: ClassVar[bool] = True
    label = tx.Alignment.GLOBAL

    def __init__(self, temperature: float = 1.0, *, learnable: bool = False) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        log_t = torch.tensor(math.log(temperature))
        if learnable:
            self.log_temperature = nn.Parameter(log_t)
        else:
            self.register_buffer("log_temperature", log_t)

    @property
    def temperature(self) -> Tensor:
        return self.log_temperature.exp()

    def is_plain(self) -> bool:
        """True when this is the standard softmax (τ = 1 and not learned)."""
        return not self.log_temperature.requires_grad and float(self.log_temperature) == 0.0

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        if not self.is_plain():
            scores = scores / self.temperature.to(scores.dtype)
        return AlignOutput(masked_softmax(scores, mask))
