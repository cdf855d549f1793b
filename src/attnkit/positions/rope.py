"""Rotary position embedding, RoPE (Su et al. 2021, RoFormer, eqs. 13-16 and 34)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.positions.base import REGISTRY, Positioned, PositionScheme, check_qk

__all__ = ["Rotary", "rotate"]


def rotate(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """R^d_{Θ,m} x for each row x (…, L, d) at position m = positions[l] (Su et al. eq. 34): the
    feature pairs (x_{2i}, x_{2i+1}) are rotated by the angle m·θ_i, θ_i = base^{−2i/d}."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    angle = positions.to(torch.float64)[:, None] * theta  # (L, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


@REGISTRY.register("rope")
class Rotary(PositionScheme):
    """Rotate each query and key by its position: q_m ↦ R_m q_m, k_n ↦ R_n k_n, so that
    (R_m q)ᵀ(R_n k) = qᵀ R_{n−m} k depends on the positions only through n − m (Su et al. eq. 16).
    No parameters; any number of heads; d must be even.

    Args:
        base: 10000 in the paper (θ_i = base^{−2i/d}).
    """

    translation_invariant = True  # reads only i − j
    per_token = True  # each vector rotated by its own position
    bias_of_positions = True  # (no bias)
    same_for_every_head = True  # (no parameters)

    def __init__(self, base: float = 10000.0) -> None:
        super().__init__()
        self.base = float(base)
        if not self.base > 1:
            raise ValueError(f"base must be > 1, got {base}")

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "rope", q_offset=q_offset, k_offset=k_offset)
        if q.shape[-1] % 2:
            raise ValueError(f"rope rotates feature pairs: d must be even, got q {tuple(q.shape)}")
        m, n = q.shape[-2], k.shape[-2]
        qpos = torch.arange(q_offset, q_offset + m, device=q.device)
        kpos = torch.arange(k_offset, k_offset + n, device=k.device)
        return Positioned(rotate(q, qpos, self.base), rotate(k, kpos, self.base))

    def transform_at(self, x: Tensor, positions: Tensor, total: int) -> Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"rope rotates feature pairs: d must be even, got {tuple(x.shape)}")
        return rotate(x, positions, self.base)

    def extra_repr(self) -> str:
        return f"base={self.base:g}"
