"""Music Transformer relative attention with the memory-linear "skewing" (Huang et al. 2019)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.positions.base import REGISTRY, Positioned, PositionScheme, check_qk

__all__ = ["MusicRelative", "skew"]


def skew(x: Tensor, n: int) -> Tensor:
    """Relative logits to absolute ones (Huang et al. 3.4.1, generalised to M ≤ N + M − 1).

    ``x`` (…, M, M + N − 1) holds query i's logit for each relative distance, column c for the
    distance D − c with D the largest (query M − 1 against key 0). Returns S (…, M, N) with
    S[i, j] = x[i, M − 1 − i + j], the logit of the distance of query i and key j. As in the
    paper, by padding one column on the left, reshaping and slicing — no (M, N) index and no
    (M, N, d) tensor of embeddings, so the memory is that of x and the result.
    """
    m, r = x.shape[-2], x.shape[-1]
    if r != m + n - 1:
        raise ValueError(f"skew: x has {r} distances but M + N − 1 = {m + n - 1} are needed")
    padded = F.pad(x, (1, 0))  # (…, M, R + 1)
    flat = padded.flatten(-2)[..., m:]  # drop the first M: row i then starts at column M − i
    return flat.unflatten(-1, (m, r))[..., :n]


@REGISTRY.register("music")
class MusicRelative(PositionScheme):
    """S^rel_ij = q_i · E^r_h[clip(i − j)], added to the scores with ``scale`` (Huang et al.
    3.4: Z = Softmax((QKᵀ + S^rel)/√d) V), E^r ∈ R^{H × (2K+1) × d} learned per head. The
    paper's decoder is causal (only i − j ≥ 0 used; with K ≥ L − 1 no distance is clipped);
    distances are clipped to [−K, K] (Shaw et al.) so that the scheme also serves an encoder.
    S^rel is computed as Q E_rᵀ over the M + N − 1 distances and then :func:`skew`-ed, O((M + N)·d)
    memory beside the logits instead of the O(M·N·d) of gathering E^r per pair (Shaw et al.).

    Args:
        head_dim: d. num_heads: H.
        max_distance: K.
        scale: factor of S^rel (default 1/√d, matching the default scaled-dot score).
    """

    translation_invariant = True  # reads only i − j

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        max_distance: int = 64,
        *,
        scale: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.max_distance = arguments.positive_int(max_distance, "max_distance")
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.weight = nn.Parameter(
            torch.empty(num_heads, 2 * max_distance + 1, head_dim, device=device, dtype=dtype)
        )
        nn.init.normal_(self.weight, std=head_dim**-0.5)

    # for_heads: relative embeddings of head_dim features per head.
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "music", num_heads=self.num_heads, q_offset=q_offset, k_offset=k_offset)
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"music was built for head_dim = {self.head_dim}, got q {q.shape}")
        m, n = q.shape[-2], k.shape[-2]
        top = q_offset + m - 1 - k_offset  # the largest i − j
        dist = torch.arange(top, top - (m + n - 1), -1, device=q.device)
        kk = self.max_distance
        table = self.weight[:, dist.clamp(-kk, kk) + kk].to(q.dtype)  # (H, M+N−1, d)
        rel = q @ table.transpose(-1, -2)  # (…, H, M, M+N−1)
        return Positioned(q, k, skew(rel, n) * self.scale)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_heads={self.num_heads}, "
            f"max_distance={self.max_distance}, scale={self.scale:g}"
        )
