"""Relation-aware self-attention with relative positions (Shaw et al. 2018, eqs. 3-6)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.positions.base import (
    REGISTRY,
    Positioned,
    PositionScheme,
    check_qk,
    relative_distances,
)

__all__ = ["ShawRelative"]


@REGISTRY.register("shaw")
class ShawRelative(PositionScheme):
    """Edge vectors a^K_ij = w^K_{clip(j − i, k)} and a^V_ij = w^V_{clip(j − i, k)}, clip(x, k) =
    max(−k, min(k, x)), in the keys and the values (Shaw et al. eqs. 3-6):

        e_ij = x_i W^Q (x_j W^K + a^K_ij)ᵀ / √d        (eq. 4)
        z_i  = Σ_j α_ij (x_j W^V + a^V_ij)              (eq. 3)

    The key term becomes a bias q_i·a^K_ij · ``scale`` on the scores (scale 1/√d, matching the
    default scaled-dot score of multi-head attention), and the value term Σ_j α_ij a^V_ij is
    returned as ``Positioned.values`` for the attention to add to each head's context. Both are
    computed from the 2k + 1 distinct vectors, never an (M, N, d) tensor: q·w^K_r for each r,
    gathered, and the weights summed per clipped distance, times w^V. The tables are shared by
    all heads, as in the paper.

    Args:
        head_dim: d, the per-head size.
        max_distance: k, the clipping distance (the paper finds k ≥ 2 enough).
        scale: factor of the key term (default 1/√d).
    """

    translation_invariant = True  # reads only i − j

    def __init__(
        self,
        head_dim: int,
        max_distance: int = 16,
        *,
        scale: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.max_distance = arguments.positive_int(max_distance, "max_distance")
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        kw = {"device": device, "dtype": dtype}
        self.key_table = nn.Parameter(torch.empty(2 * max_distance + 1, head_dim, **kw))  # w^K
        self.value_table = nn.Parameter(torch.empty(2 * max_distance + 1, head_dim, **kw))  # w^V
        for w in (self.key_table, self.value_table):
            nn.init.normal_(w, std=head_dim**-0.5)

    # for_heads: edge vectors of head_dim features, shared by the heads.
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    def index(self, m: int, n: int, q_offset: int, k_offset: int, device) -> Tensor:
        """(M, N) row of w^K / w^V for each pair: clip(j − i, k) + k."""
        k = self.max_distance
        return (-relative_distances(m, n, q_offset, k_offset, device)).clamp(-k, k) + k

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "shaw", q_offset=q_offset, k_offset=k_offset)
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"shaw was built for head_dim = {self.head_dim} but got q {tuple(q.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        idx = self.index(m, n, q_offset, k_offset, q.device)
        per_distance = q @ self.key_table.to(q.dtype).T  # (…, M, 2k+1): q_i · w^K_r
        bias = per_distance.gather(-1, idx.expand(*per_distance.shape[:-1], n)) * self.scale
        table = self.value_table

        def values(weights: Tensor) -> Tensor:
            """Σ_j α_ij a^V_ij = Σ_r (Σ_{j: clip(j−i)=r} α_ij) w^V_r: (…, M, N) -> (…, M, d)."""
            summed = weights.new_zeros(*weights.shape[:-1], table.shape[0])
            summed = summed.scatter_add(-1, idx.expand(weights.shape), weights)
            return summed @ table.to(weights.dtype)

        return Positioned(q, k, bias, values)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_distance={self.max_distance}, scale={self.scale:g}"
