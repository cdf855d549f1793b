"""Skyformer (Chen, Zeng, Ji and Yang, "Skyformer: Remodel Self-Attention with Gaussian Kernel and
Nyström Method", NeurIPS 2021; Soydaner 5.3): softmax's exp(q·k/√d) is replaced by the Gaussian
kernel κ(q, k) = exp(−‖q − k‖²/(2√d)) (the paper's "Kernelized Attention", C V with C = κ(Q, K),
not normalised over the keys), and C is approximated by the Nyström method applied where it is
sound: C is the off-diagonal block of the kernel matrix of all 2N points [Q; K],

    B̄ = κ([Q; K], [Q; K]),   symmetric positive semi-definite,

so with landmarks L (m rows of the space of [Q; K]) the Nyström approximation of B̄ gives

    Ĉ = κ(Q, L) · κ(L, L)⁺ · κ(L, K),

and with every point of [Q; K] a landmark, Ĉ = C exactly (B̄ B̄⁺ B̄ = B̄). Unlike Nyströmformer's
softmax factors, these are blocks of one PSD kernel matrix, for which Nyström's guarantees hold.

Differences from the paper, said plainly: the paper samples landmark columns at random from the
2N points; here the landmarks are segment means of [Q; K] (deterministic, as
:class:`attnkit.efficient.NystromAttention`), and κ(L, L)⁺ is taken by Nyströmformer's iteration
(:func:`attnkit.efficient.landmarks.iterative_pinv`).

Masks and bias as :class:`attnkit.efficient.NystromAttention` (padded queries and keys are left
out of the landmarks; per-query masks are refused).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import masks
from attnkit import taxonomy as tx
from attnkit.efficient.landmarks import (
    GaussianKernel,
    LandmarkAttention,
    gaussian_scores,
    segment_means,
)
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor

__all__ = ["Skyformer"]


@REGISTRY.register("skyformer")
class Skyformer(LandmarkAttention):
    """Skyformer, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q
    (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        num_landmarks: m, segment-mean landmarks of the concatenation [Q; K] (M + N points).
        iterations: steps of the pseudo-inverse iteration.

    The named weights are the kernel factors κ(Q, L) and κ(L, K) (values in (0, 1]); the dense
    Ĉ of ``need_weights=True`` may have negative entries.
    """

    score = staticmethod(gaussian_scores)

    def __init__(self, num_landmarks: int = 64, *, iterations: int = 6) -> None:
        super().__init__(num_landmarks, iterations, GaussianKernel())

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (51, 52, 53))
        mask = masks.from_lengths(torch.tensor([7, 3]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def landmarks(
        self, q: Tensor, k: Tensor, query_keep: Tensor | None, key_keep: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One landmark set L for both sides: segment means of the real rows of [Q; K]."""
        points = torch.cat((q, k), -2)
        keep = None
        if query_keep is not None or key_keep is not None:
            qk = torch.ones_like(q[..., :1], dtype=torch.bool) if query_keep is None else query_keep
            kk = torch.ones_like(k[..., :1], dtype=torch.bool) if key_keep is None else key_keep
            lead = torch.broadcast_shapes(qk.shape[:-2], kk.shape[:-2])
            m, n = q.shape[-2], k.shape[-2]
            keep = torch.cat((qk.broadcast_to(*lead, m, 1), kk.broadcast_to(*lead, n, 1)), -2)
        landmarks, present = segment_means(points, self.num_landmarks, keep)
        return landmarks, present, landmarks, present
