"""Locality over a graph distance (Galassi V-C): a Gaussian or hard window over a distance the
user supplies — e.g. the distance between two words along the dependency tree (Chen et al.
2017; He et al. 2018) — instead of the distance between positions."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, centered, masked_softmax
from attnkit.sizing import example_sizes

__all__ = ["GraphLocal", "tree_distance"]


def tree_distance(parents: Tensor) -> Tensor:
    """Path lengths between the nodes of trees given by parent pointers.

    Args:
        parents: (…, N) integer tensor, the parent index of each node, −1 for a root (as in a
            dependency parse; several roots make a forest).

    Returns:
        (…, N, N) float64 distances along the tree edges; ``inf`` between nodes of different
        trees.
    """
    if (
        not isinstance(parents, Tensor)
        or parents.dtype.is_floating_point
        or parents.dtype == torch.bool
    ):
        raise TypeError(f"parents must be an integer tensor (…, N), got {parents!r}")
    n = parents.shape[-1]
    if parents.numel() and (int(parents.min()) < -1 or int(parents.max()) >= n):
        raise ValueError(f"parents must lie in [-1, {n - 1}] (−1: a root)")
    lead = parents.shape[:-1]
    dist = torch.full((*lead, n, n), math.inf, dtype=torch.float64, device=parents.device)
    idx = torch.arange(n, device=parents.device)
    dist[..., idx, idx] = 0.0
    has = parents >= 0
    edge = torch.zeros((*lead, n, n), dtype=torch.bool, device=parents.device)
    edge.scatter_(-1, parents.clamp_min(0).unsqueeze(-1), has.unsqueeze(-1))
    edge = edge | edge.transpose(-1, -2)
    dist = torch.where(edge, torch.ones((), dtype=torch.float64), dist)
    for k in range(n):  # Floyd–Warshall
        dist = torch.minimum(dist, dist[..., :, k : k + 1] + dist[..., k : k + 1, :])
    return dist


@REGISTRY.register("graph_local")
class GraphLocal(Alignment):
    """a_l ∝ exp(e_l − d_l² / (2σ²)) over the keys with d_l ≤ D (Galassi V-C).

    d (…, M, N) is the distance from each query to each key, supplied by the user (e.g.
    :func:`tree_distance` of a dependency parse, for self-attention over its words). Without
    one it is the distance between positions, |m − n|, and the alignment is a Gaussian local
    alignment (Brauwers eq. 29 as a bias).

    Args:
        sigma: σ > 0 of the Gaussian bias (None: no bias, a hard window only).
        window: D ≥ 0, keys farther away get weight 0 (None: no window).
        learnable: learn σ (as log σ, so it stays positive).
        distance: a fixed distance (…, M, N) used when ``forward`` gets none.
        device, dtype: of the learned log σ.

    Keys at distance ``inf`` (not connected) get weight 0; a row with no key in reach gets 0.
    """

    position_based: ClassVar[bool] = True
    query_position_based: ClassVar[bool] = True  # |m − n|, or a distance laid out (M, N)
    label = tx.AlignmentKind.LOCAL

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        """σ = 1.5."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), sigma=1.5)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Alignment]:
        """The example, and the hard window of radius 1 (σ = None)."""
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        window = cls.for_heads(**s, sigma=None, window=1.0)
        return {"": cls.example(**sizes), "window": window}

    def __init__(
        self,
        sigma: float | None = 1.0,
        *,
        window: float | None = None,
        learnable: bool = False,
        distance: Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if sigma is not None and (
            isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0
        ):
            raise ValueError(f"sigma must be a number > 0 or None, got {sigma!r}")
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, (int, float)) or not window >= 0
        ):
            raise ValueError(f"window must be a number >= 0 or None, got {window!r}")
        if sigma is None and window is None:
            raise ValueError("give sigma (a Gaussian bias), window (a hard window) or both")
        if not isinstance(learnable, bool):
            raise TypeError(f"learnable must be a bool, got {learnable!r}")
        if learnable and sigma is None:
            raise ValueError("learnable=True learns sigma: give its starting value")
        self.window = None if window is None else float(window)
        self.fixed_sigma = None if (sigma is None or learnable) else float(sigma)
        if learnable:
            assert sigma is not None
            self.log_sigma = nn.Parameter(torch.tensor(math.log(sigma), device=device, dtype=dtype))
        self.gaussian = sigma is not None
        fixed = None if distance is None else self._checked(distance, None)
        self.register_buffer("distance", fixed, persistent=False)

    @staticmethod
    def _checked(distance: object, scores: Tensor | None) -> Tensor:
        if not isinstance(distance, Tensor) or distance.dtype == torch.bool:
            raise TypeError(f"distance must be a numeric tensor (…, M, N), got {distance!r}")
        if distance.dim() < 2:
            raise ValueError(f"distance must be (…, M, N), got shape {tuple(distance.shape)}")
        if scores is not None and not inputs.broadcasts_to(distance.shape, tuple(scores.shape)):
            raise ValueError(
                f"distance of shape {tuple(distance.shape)} does not broadcast to the scores "
                f"{tuple(scores.shape)}"
            )
        if bool(torch.isnan(distance.double()).any()) or bool((distance < 0).any()):
            raise ValueError("distance must be >= 0 and not NaN (inf: not connected)")
        return distance

    def _sigma(self, dtype: torch.dtype) -> Tensor | float:
        if self.fixed_sigma is not None:
            return self.fixed_sigma
        return self.log_sigma.exp().to(dtype)

    def forward(
        self,
        scores: Tensor,
        mask: Tensor | None = None,
        *,
        query: Tensor | None = None,
        distance: Tensor | None = None,
    ) -> AlignOutput:
        """Weights (…, M, N) from scores (…, M, N).

        Args:
            distance: (…, M, N), broadcastable to the scores, ≥ 0; default the module's
                ``distance``, else |m − n|.
        """
        scores = inputs.alignment_inputs(self, scores, mask)
        if distance is None:
            distance = self.distance
        if distance is None:
            m, n = scores.shape[-2:]
            rows = torch.arange(m, device=scores.device, dtype=scores.dtype).unsqueeze(-1)
            d = (rows - torch.arange(n, device=scores.device, dtype=scores.dtype)).abs()
        else:
            d = self._checked(distance, scores).to(device=scores.device, dtype=scores.dtype)
        allowed = torch.isfinite(d)
        if self.window is not None:
            allowed = allowed & (d <= self.window)
        if mask is not None:
            allowed = allowed & mask
        e = scores
        if self.gaussian:
            zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
            near = torch.where(allowed, d, zero)  # inf distances must not reach the gradient
            e = centered(scores, allowed) - near**2 / (2 * self._sigma(scores.dtype) ** 2)
        return AlignOutput(masked_softmax(e, allowed.expand(scores.shape)))
