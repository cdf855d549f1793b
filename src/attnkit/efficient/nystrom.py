"""Nyström attention (Xiong, Zeng, Chakraborty, Tan, Fung, Li and Singh, "Nyströmformer: A
Nyström-Based Algorithm for Approximating Self-Attention", AAAI 2021; Soydaner 5.3): softmax
attention approximated from m landmarks in O((M + N)·m·d):

    Ŝ V = softmax(Q K̃ᵀ/√d) · Z · (softmax(Q̃ Kᵀ/√d) V),   Z ≈ softmax(Q̃ K̃ᵀ/√d)⁺

(the paper's approximation), where the landmarks Q̃, K̃ (m × d) are the means of m consecutive
segments of the queries and keys and Z is the pseudo-inverse by the paper's iteration
(:func:`attnkit.efficient.landmarks.iterative_pinv`). With m = N landmarks each landmark is one
token and, with Z converged, Ŝ = S S⁺ S = S: exact softmax attention.

Omitted: the paper's optional skip connection (a depthwise convolution of V added to the output),
which is a separate layer rather than part of the attention (add it outside the part).

Masks: a padding mask (key padding (…, 1, N), padded queries as all-False rows) is honoured —
padded keys and queries are left out of the segment means and of every softmax, so padding equals
truncation. The query landmarks are means of all real queries, so a padded query counts only when
it is named as one (an all-False row); in the self-attention of
:class:`attnkit.MultiHeadAttention` a key-padding mask names the padded queries too (the part
sets ``mixes_queries``). The landmarks are shared by all queries, so causal and other per-query
masks are refused (there is no causal Nyström attention in the paper). Sequences shorter than m
leave some landmarks empty; they are masked out (the pseudo-inverse handles the singular middle
matrix).

Weights: ``need_weights=True`` returns the dense approximation Ŝ (…, M, N), whose entries may be
negative (a pseudo-inverse); the two softmax factors are the named, non-negative weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.efficient.landmarks import (
    LandmarkAttention,
)
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["NystromAttention"]


@REGISTRY.register("nystrom")
class NystromAttention(LandmarkAttention):
    """Nyströmformer attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)``
    with q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        num_landmarks: m, the number of segment-mean landmarks of the queries and of the keys.
        iterations: steps of the pseudo-inverse iteration (the paper uses 6).

    Bias is refused (the (M, N) scores are never formed).
    """

    def __init__(self, num_landmarks: int = 64, *, iterations: int = 6) -> None:
        super().__init__(num_landmarks, iterations, Softmax())

    @staticmethod
    def score(x: Tensor, y: Tensor) -> Tensor:
        """Scaled dot products x yᵀ/√d (x scaled: (P, d) multiplications, not (P, R))."""
        return (x * x.shape[-1] ** -0.5) @ y.transpose(-1, -2)

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (31, 32, 33))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(3), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.GLOBAL]
