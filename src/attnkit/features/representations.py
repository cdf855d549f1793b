"""Multi-representational attention: meta-embeddings (Kiela et al.; Brauwers 3.1.3, eqs. 21-22)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.attention import Attention
from attnkit.scores import Additive, Score

__all__ = ["MetaEmbedding", "MetaEmbeddingOutput"]


class MetaEmbeddingOutput(NamedTuple):
    """Meta-embeddings x⁽ᵉ⁾ (…, d_t) and the weights over the E representations (…, E)."""

    embedding: Tensor
    weights: Tensor


class MetaEmbedding(nn.Module):
    """x⁽ᵗⁱ⁾ = W_{e_i} x⁽ᵉⁱ⁾ + b_{e_i} (eq. 21); a = align(score(x⁽ᵗ¹⁾ … x⁽ᵗᴱ⁾)) by
    self-attention over the E projected embeddings; x⁽ᵉ⁾ = Σ_i a_i x⁽ᵗⁱ⁾ (eq. 22).

    Args:
        dims: sizes d_{e_1} … d_{e_E} of the E embeddings.
        d_t: common size after projection.
        d_w: hidden size of the default self-attentive additive score (eq. 33).
    """

    def __init__(
        self, dims: list[int], d_t: int, d_w: int = 32, *, score: Score | None = None
    ) -> None:
        super().__init__()
        if len(dims) < 1:
            raise ValueError("MetaEmbedding needs at least one embedding size")
        self.project = nn.ModuleList([nn.Linear(d, d_t) for d in dims])
        self.attention = Attention(score or Additive(None, d_t, d_w))

    def taxonomy_tags(self) -> list:
        return [tx.FeatureRepresentations.MULTI]

    def forward(self, embeddings: list[Tensor]) -> MetaEmbeddingOutput:
        """embeddings: E tensors (…, d_{e_i}) with the same leading dims."""
        if len(embeddings) != len(self.project):
            raise ValueError(f"expected {len(self.project)} embeddings, got {len(embeddings)}")
        x = torch.stack([p(e) for p, e in zip(self.project, embeddings, strict=True)], dim=-2)
        out = self.attention(None, x, need_weights=True)  # x: (…, E, d_t)
        return MetaEmbeddingOutput(out.context.squeeze(-2), out.weights.squeeze(-2))
