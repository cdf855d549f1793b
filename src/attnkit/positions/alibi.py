"""ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long")."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.positions.base import (
    REGISTRY,
    Positioned,
    PositionScheme,
    check_qk,
    relative_distances,
)

__all__ = ["ALiBi", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> list[float]:
    """The head-specific slopes m_h (Press et al. 3): for H a power of two the geometric
    sequence 2^{−8/H}, 2^{−16/H}, …, 2^{−8}; otherwise the slopes of the closest smaller power of
    two c, followed by every other slope of 2c until H are given."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    c = 2 ** math.floor(math.log2(num_heads))
    return geometric(c) + geometric(2 * c)[0::2][: num_heads - c]


@REGISTRY.register("alibi")
class ALiBi(PositionScheme):
    """Bias −m_h · |i − j| added to head h's scores (Press et al. 3): a penalty linear in the
    distance, steeper for some heads than others; no position embedding, no parameters. The
    paper's causal bias −m_h (i − j), j ≤ i, is this one under a causal mask. The number of
    heads is read from q (…, H, M, d).
    """

    translation_invariant = True  # reads only i − j
    per_token = True  # (no transform of q and k)
    adds_bias = True
    bias_of_positions = True

    def bias_at(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        heads = e.shape[-3] if e.dim() >= 3 else 1
        slopes = torch.tensor(alibi_slopes(heads), dtype=e.dtype, device=e.device)
        return e - slopes[h] * (q_idx - kv_idx).abs().to(e.dtype)

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "alibi", num_heads=None, q_offset=q_offset, k_offset=k_offset)
        if q.dim() < 3:
            raise ValueError(f"alibi needs per-head q (…, H, M, d), got shape {tuple(q.shape)}")
        h, m, n = q.shape[-3], q.shape[-2], k.shape[-2]
        slopes = torch.tensor(alibi_slopes(h), device=q.device, dtype=q.dtype)
        dist = relative_distances(m, n, q_offset, k_offset, q.device).abs().to(q.dtype)
        return Positioned(q, k, -slopes[:, None, None] * dist)
