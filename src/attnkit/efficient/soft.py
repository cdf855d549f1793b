"""SOFT, softmax-free attention (Lu, Yao, Zhang, Zhu, Xu, Gao, Xu, Xiang and Zhang, "SOFT:
Softmax-free Transformer with Linear Complexity", NeurIPS 2021; Soydaner 5.3): the softmax of dot
products is replaced by the Gaussian kernel, unnormalised,

    S_ij = exp(−‖q_i − k_j‖² / (2√d)),

and S is approximated from m landmarks by the Nyström form:

    Ŝ = exp(Q ⊖ K̃) · exp(Q̃ ⊖ K̃)⁺ · exp(Q̃ ⊖ K),    output Ŝ V,

where exp(X ⊖ Y) is the matrix of exp(−‖x_i − y_j‖² / (2√d)), and the pseudo-inverse by
Newton-Schulz iterations (:func:`attnkit.efficient.landmarks.newton_pinv`). With every token a
landmark, Ŝ = S S⁺ S = S.

Differences from the paper, said plainly: the paper ties keys to queries (K = Q, one projection),
which makes the middle matrix a symmetric positive-definite kernel matrix; a per-head part
receives q and k from separate projections, so it uses Q̃ from the queries and K̃ from the keys
(pass the same tensor as q and k for the tied form). Landmarks are segment means (average
pooling, as :class:`attnkit.efficient.NystromAttention`), not the paper's learned strided
convolution followed by layer norm and GELU.

Masks and bias as :class:`attnkit.efficient.NystromAttention` (padding honoured, per-query masks
refused: no causal form in the paper).
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
    newton_pinv,
)
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor

__all__ = ["SoftmaxFreeAttention"]


@REGISTRY.register("soft")
class SoftmaxFreeAttention(LandmarkAttention):
    """SOFT, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, M, d),
    k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        num_landmarks: m, segment-mean landmarks of the queries and of the keys.
        iterations: Newton-Schulz steps for the pseudo-inverse (the paper's code uses 20).

    The named weights are the two kernel factors (values in (0, 1], not normalised); the dense
    Ŝ of ``need_weights=True`` may have negative entries.
    """

    score = staticmethod(gaussian_scores)

    def __init__(self, num_landmarks: int = 64, *, iterations: int = 20) -> None:
        super().__init__(num_landmarks, iterations, GaussianKernel())

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (41, 42, 43))
        mask = masks.from_lengths(torch.tensor([7, 4]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(3), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def pseudo_inverse(self, a: Tensor) -> Tensor:
        """Z ≈ A⁺ by Newton-Schulz steps (SOFT's)."""
        return newton_pinv(a, self.iterations)
