"""Learned absolute position embeddings (Gehring et al. 2017; BERT, GPT)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs
from attnkit.positions.base import REGISTRY, AbsolutePosition

__all__ = ["Learned"]


@REGISTRY.register("learned")
class Learned(AbsolutePosition):
    """x + P[offset : offset + L] with P ∈ R^{max_len × D} learned (Vaswani et al. 3.5 compare
    it with the sinusoids: nearly identical results, but no positions beyond max_len).

    Args:
        d_model: D, the embedding size.
        max_len: the number of positions with an embedding; a longer input is refused.
    """

    def __init__(self, d_model: int, max_len: int = 512, *, device=None, dtype=None) -> None:
        super().__init__()
        self.d_model = arguments.positive_int(d_model, "d_model")
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.weight = nn.Parameter(torch.empty(max_len, d_model, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """x (B, …, L, D) -> x + P[offset + l] for l < L."""
        inputs.tensor(x, "x")
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x has {x.shape[-1]} features (shape {tuple(x.shape)}) but d_model = "
                f"{self.d_model}"
            )
        end = offset + x.shape[-2]
        if offset < 0 or end > self.max_len:
            raise ValueError(
                f"positions {offset}..{end - 1} are outside the learned table of max_len = "
                f"{self.max_len} (x of shape {tuple(x.shape)}, offset {offset})"
            )
        return x + self.weight[offset:end].to(x.dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}"
