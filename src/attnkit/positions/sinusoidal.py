"""Sinusoidal absolute position encoding (Vaswani et al. 2017, section 3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit import arguments, inputs
from attnkit.positions.base import REGISTRY, AbsolutePosition

__all__ = ["Sinusoidal", "sinusoid_table"]


@arguments.renamed(d_model="embed_dim")
def sinusoid_table(positions: Tensor, embed_dim: int, base: float = 10000.0) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^{2i/D}), PE(pos, 2i+1) = cos(pos / base^{2i/D}):
    (…,) positions -> (…, D), in the dtype of ``positions`` if floating (float32 otherwise)."""
    dtype = positions.dtype if positions.dtype.is_floating_point else torch.float32
    i = torch.arange(0, embed_dim, 2, device=positions.device, dtype=dtype)
    angle = positions.to(dtype)[..., None] * torch.exp(-math.log(base) * i / embed_dim)
    table = torch.empty(*positions.shape, embed_dim, device=positions.device, dtype=dtype)
    table[..., 0::2] = torch.sin(angle)
    table[..., 1::2] = torch.cos(angle[..., : embed_dim // 2])
    return table


@REGISTRY.register("sinusoidal")
@arguments.renamed(d_model="embed_dim")
class Sinusoidal(AbsolutePosition):
    """x + PE[offset : offset + L], PE fixed sinusoids of geometrically spaced wavelengths
    (2π … base·2π), so that PE(pos + k) is a linear function of PE(pos) (Vaswani et al. 3.5).

    Args:
        embed_dim: D, the embedding size (even).
        base: 10000 in the paper.
    """

    def __init__(self, embed_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        if embed_dim % 2:
            raise ValueError(f"embed_dim must be even for sine/cosine pairs, got {embed_dim}")
        self.base = float(base)
        if not self.base > 1:
            raise ValueError(f"base must be > 1, got {base}")

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """x (B, …, L, D) -> x + PE(offset + l) for l < L."""
        arguments.nonnegative_int(offset, "offset")
        inputs.tensor(x, "x")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x has {x.shape[-1]} features (shape {tuple(x.shape)}) but embed_dim = "
                f"{self.embed_dim}"
            )
        pos = torch.arange(offset, offset + x.shape[-2], device=x.device, dtype=torch.float64)
        return x + sinusoid_table(pos, self.embed_dim, self.base).to(x.dtype)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, base={self.base:g}"
