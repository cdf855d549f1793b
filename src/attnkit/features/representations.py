"""Multi-representational attention: meta-embeddings (Kiela et al.; Brauwers 3.1.3, eqs. 21-22)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive, Score

__all__ = ["MetaEmbedding", "MetaEmbeddingOutput"]


class MetaEmbeddingOutput(NamedTuple):
    """Meta-embeddings x⁽ᵉ⁾ (…, d_t) and the weights over the E representations (…, E)."""

    embedding: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.embedding

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("meta_embedding")
class MetaEmbedding(nn.Module):
    """x⁽ᵗⁱ⁾ = W_{e_i} x⁽ᵉⁱ⁾ + b_{e_i} (eq. 21); a = align(score(x⁽ᵗ¹⁾ … x⁽ᵗᴱ⁾)) by
    self-attention over the E projected embeddings; x⁽ᵉ⁾ = Σ_i a_i x⁽ᵗⁱ⁾ (eq. 22).

    Args:
        dims: sizes d_{e_1} … d_{e_E} of the E embeddings.
        d_t: common size after projection.
        d_w: hidden size of the default self-attentive additive score (eq. 33).
    """

    def __init__(
        self,
        dims: list[int],
        d_t: int,
        d_w: int = 32,
        *,
        score: Score | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(dims, (list, tuple)):
            raise TypeError(f"dims must be a list of positive ints, got {dims!r}")
        sizes(d_t=d_t, d_w=d_w, **{f"dims[{i}]": d for i, d in enumerate(dims)})
        if len(dims) < 1:
            raise ValueError("MetaEmbedding needs at least one embedding size")
        kw = {"device": device, "dtype": dtype}
        self.project = nn.ModuleList([nn.Linear(d, d_t, **kw) for d in dims])
        self.attention = Attention(
            checks.optional_score(score, "score") or Additive(None, d_t, d_w, **kw)
        )

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(module, ([x⁽ᵉ¹⁾ (2, 3, 3), x⁽ᵉ²⁾ (2, 3, 5)],), {})."""
        embeddings = [example_tensor(2, 3, 3, seed=1), example_tensor(2, 3, 5, seed=2)]
        return cls([3, 5], 4, 6), (embeddings,), {}

    def taxonomy_tags(self) -> list:
        return [tx.FeatureRepresentations.MULTI]

    def forward(self, embeddings: list[Tensor]) -> MetaEmbeddingOutput:
        """embeddings: E tensors (…, d_{e_i}) with the same leading dims. No mask: every
        representation of every token takes part."""
        if not isinstance(embeddings, (list, tuple)):
            raise TypeError(
                f"embeddings must be a list of {len(self.project)} tensors, got "
                f"{type(embeddings).__name__}"
            )
        if len(embeddings) != len(self.project):
            raise ValueError(f"expected {len(self.project)} embeddings, got {len(embeddings)}")
        for i, (e, p) in enumerate(zip(embeddings, self.project, strict=True)):
            name = f"embeddings[{i}]"
            checks.tensor(e, name, min_dim=1)
            if e.shape[-1] != p.in_features:
                raise ValueError(
                    f"{name} has {e.shape[-1]} features (shape {tuple(e.shape)}) but the module "
                    f"was built for dims[{i}] = {p.in_features}"
                )
            checks.part_matches(p, f"projection {i}", name, e)
            if e.shape[:-1] != embeddings[0].shape[:-1]:
                raise ValueError(
                    f"{name} has leading dims {tuple(e.shape[:-1])} but embeddings[0] has "
                    f"{tuple(embeddings[0].shape[:-1])}"
                )
        x = torch.stack([p(e) for p, e in zip(self.project, embeddings, strict=True)], dim=-2)
        out = self.attention(None, x, need_weights=True)  # x: (…, E, d_t)
        return MetaEmbeddingOutput(out.context.squeeze(-2), out.weights.squeeze(-2))
