"""Sparse alignments with exact zeros: sparsemax and α-entmax (Galassi IV-C; Peters et al.).

The distributions come from the ``entmax`` package; this module adds masks, fully-masked rows
and a learnable α.
"""

from __future__ import annotations

import math
from typing import ClassVar

import entmax
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput

__all__ = ["Entmax", "Entmax15", "Sparsemax"]


def _prepare(scores: Tensor, mask: Tensor | None, gap: float) -> tuple[Tensor, Tensor | None]:
    """Replace masked scores by (row max − gap): a value that α-entmax maps to exactly 0.

    For α-entmax, p_l > 0 needs (α−1)(max − e_l) < 1, so any gap > 1/(α−1) gives p_l = 0
    while keeping everything finite (−inf breaks the sort-based algorithms). The fill is
    detached: masked keys receive no gradient.
    """
    if mask is None:
        return scores, None
    any_key = mask.any(dim=-1, keepdim=True)
    row_max = scores.masked_fill(~mask, float("-inf")).amax(dim=-1, keepdim=True)
    row_max = torch.where(any_key, row_max, torch.zeros((), dtype=scores.dtype)).detach()
    return torch.where(mask, scores, row_max - gap), mask & any_key


class _Sparse(Alignment):
    streamable: ClassVar[bool] = True
    label = tx.Alignment.SPARSE

    def _alpha(self) -> float:
        raise NotImplementedError

    def _map(self, scores: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        filled, keep = _prepare(scores, mask, 1.0 / (self._alpha() - 1.0) + 1.0)
        weights = self._map(filled)
        return AlignOutput(weights if keep is None else weights * keep)


@REGISTRY.register("sparsemax")
class Sparsemax(_Sparse):
    """sparsemax(e) = argmin_{a ∈ Δ} ‖a − e‖² (Martins & Astudillo; Galassi IV-C); α = 2."""

    def _alpha(self) -> float:
        return 2.0

    def _map(self, scores: Tensor) -> Tensor:
        return entmax.sparsemax(scores, dim=-1)


@REGISTRY.register("entmax15")
class Entmax15(_Sparse):
    """1.5-entmax (Peters et al.), computed exactly by sorting."""

    def _alpha(self) -> float:
        return 1.5

    def _map(self, scores: Tensor) -> Tensor:
        return entmax.entmax15(scores, dim=-1)


@REGISTRY.register("entmax")
class Entmax(_Sparse):
    """α-entmax for any α > 1 (α → 1 is softmax, α = 2 sparsemax), by bisection.

    Args:
        alpha: α > 1.
        learnable: learn α (kept above 1 as α = 1 + softplus(ρ)), as in adaptively sparse
            Transformers (Soydaner).
        n_iter: bisection steps.
    """

    def __init__(self, alpha: float = 1.5, *, learnable: bool = False, n_iter: int = 50) -> None:
        super().__init__()
        if not alpha > 1:
            raise ValueError(f"alpha must be > 1 (alpha = 1 is softmax), got {alpha!r}")
        # inverse softplus of alpha - 1
        rho = torch.tensor(math.log(math.expm1(alpha - 1.0)))
        if learnable:
            self.rho = nn.Parameter(rho)
        else:
            self.register_buffer("rho", rho)
        self.n_iter = n_iter

    @property
    def alpha(self) -> Tensor:
        return 1.0 + F.softplus(self.rho)

    def _alpha(self) -> float:
        return float(self.alpha.detach())

    def _map(self, scores: Tensor) -> Tensor:
        alpha = self.alpha.to(scores.dtype).expand(*scores.shape[:-1], 1)
        return entmax.entmax_bisect(scores, alpha, dim=-1, n_iter=self.n_iter)
