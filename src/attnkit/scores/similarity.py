"""Similarity score functions (Brauwers Table II "similarity"; Galassi IV-B, Graves et al.)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.scores.base import REGISTRY, Score
from attnkit.scores.multiplicative import Dot

__all__ = ["Cosine", "Euclidean"]


@REGISTRY.register("cosine")
class Cosine(Dot):
    """Cosine similarity: e_l = qᵀ k_l / (‖q‖ ‖k_l‖). Needs d_q = d_k.

    A dot product of unit vectors, hence in dot-product form. ``eps`` > 0 guards zero vectors
    (a norm below eps is taken as eps).
    """

    scoring = tx.Scoring.SIMILARITY
    dot_product_form: ClassVar[bool] = True

    def __init__(self, eps: float = 1e-8) -> None:
        super().__init__()
        self.eps = arguments.finite_float(eps, "eps", positive=True)

    def project_query(self, q: Tensor | None) -> Tensor | None:
        assert q is not None
        return F.normalize(q, dim=-1, eps=self.eps)

    def project_key(self, k: Tensor) -> Tensor:
        return F.normalize(k, dim=-1, eps=self.eps)

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        self.check(q, k)
        qp = self.project_query(q)
        assert qp is not None
        return qp, self.project_key(k), 1.0


@REGISTRY.register("euclidean")
class Euclidean(Score):
    """Negative Euclidean (L2) distance: e_l = −‖q − k_l‖₂. Needs d_q = d_k."""

    scoring = tx.Scoring.SIMILARITY
    check = Dot.check

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        assert qp is not None
        lead = torch.broadcast_shapes(qp.shape[:-2], kp.shape[:-2])
        qp = qp.expand(*lead, *qp.shape[-2:])
        kp = kp.expand(*lead, *kp.shape[-2:])
        if qp.dtype in (torch.float16, torch.bfloat16):
            # cdist has no half-precision CPU kernels: compute in float32, return the input dtype.
            return -torch.cdist(qp.float(), kp.float()).to(qp.dtype)
        return -torch.cdist(qp, kp)
