"""Self-attentive score with a learned query (Brauwers eq. 34)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.scores.base import REGISTRY, Score, expect_features
from attnkit.sizing import example_sizes

__all__ = ["LearnedQuery"]


@REGISTRY.register("learned_query")
@arguments.renamed(heads="num_heads")
class LearnedQuery(Score):
    """e_l = qᵀ k_l with q ∈ R^{d_k} a trainable vector (Brauwers eq. 34); ``scaled`` divides
    by √d_k. Query-free: the caller's query, if any, only sets the number of rows M.
    """

    scoring = tx.Scoring.MULTIPLICATIVE
    dot_product_form: ClassVar[bool] = True
    query_free = True

    def __init__(
        self,
        d_k: int,
        *,
        scaled: bool = False,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_k = arguments.positive_int(d_k, "d_k")
        self.scaled = arguments.boolean(scaled, "scaled")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        shape = (1, d_k) if num_heads is None else (num_heads, 1, d_k)
        bound = 1.0 / math.sqrt(d_k)
        self.query = nn.Parameter(
            torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound)
        )

    # for_heads: d_k = head_dim, one learned query per head.
    size_arguments: ClassVar[dict[str, str]] = {"d_k": "head_dim", "num_heads": "num_heads"}

    @classmethod
    def example(cls, **sizes: int | None) -> Score:
        """Scaled by 1/√d_k."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), scaled=True)

    def check(self, q: Tensor | None, k: Tensor) -> None:
        expect_features(k, self.d_k, "k", "d_k")

    def _scale(self) -> float:
        return 1.0 / math.sqrt(self.d_k) if self.scaled else 1.0

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        return torch.matmul(self.query, kp.transpose(-1, -2)) * self._scale()

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        self.check(q, k)
        lead = k.shape[:-2] if q is None else torch.broadcast_shapes(k.shape[:-2], q.shape[:-2])
        m = 1 if q is None else q.shape[-2]
        learned = self.query.expand(*lead, m, self.d_k).contiguous()
        return learned, k, self._scale()
