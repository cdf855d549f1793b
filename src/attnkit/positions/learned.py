"""Learned absolute position embeddings (Gehring et al. 2017; BERT, GPT)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs
from attnkit.positions.base import REGISTRY, AbsolutePosition

__all__ = ["Learned"]


@REGISTRY.register("learned")
@arguments.renamed(d_model="embed_dim")
class Learned(AbsolutePosition):
    """x + P[offset : offset + L] with P ∈ R^{max_len × D} learned (Vaswani et al. 3.5 compare
    it with the sinusoids: nearly identical results, but no positions beyond max_len).

    Args:
        embed_dim: D, the embedding size.
        max_len: the number of positions with an embedding; a longer input is refused.
    """

    size_arguments: ClassVar[dict[str, str]] = {"embed_dim": "embed_dim", "max_len": "max_len"}

    def __init__(self, embed_dim: int, max_len: int = 512, *, device=None, dtype=None) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.weight = nn.Parameter(torch.empty(max_len, embed_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """x (B, …, L, D) -> x + P[offset + l] for l < L."""
        inputs.tensor(x, "x")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x has {x.shape[-1]} features (shape {tuple(x.shape)}) but embed_dim = "
                f"{self.embed_dim}"
            )
        end = offset + x.shape[-2]
        if offset < 0 or end > self.max_len:
            raise ValueError(
                f"positions {offset}..{end - 1} are outside the learned table of max_len = "
                f"{self.max_len} (x of shape {tuple(x.shape)}, offset {offset})"
            )
        return x + self.weight[offset:end].to(x.dtype)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, max_len={self.max_len}"
