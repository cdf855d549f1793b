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

Cost: without a mask, weights or a listener the two (…, M, m) and (…, m, N) factors are never
formed (:meth:`NystromAttention.forward`): O((M + N)·m·d + m³) time and O((M + N)·d + m²)
memory; otherwise the factors are kept for the backward pass, O((M + N)·m) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import hooks, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.efficient.landmarks import LandmarkAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["NystromAttention"]

# Input dtypes of the fused path (half precision takes the general path, in float32).
_FUSED_DTYPES = (torch.float32, torch.float64)


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

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        """The context F (Z (B V)) (see :func:`attnkit.efficient.landmarks.landmark_attention`).

        Without a mask, bias, weights or a listener, and with every landmark present (M, N ≥ m),
        the two softmax factors are never formed: F W = softmax(Q K̃ᵀ/√d) W and B V =
        softmax(Q̃ Kᵀ/√d) V are softmax attention of the queries over the m landmark keys and
        of the m landmark queries over the keys, evaluated by PyTorch's fused
        ``scaled_dot_product_attention`` (its backward recomputes the tiles), so the memory is
        O((M + N)·d + m²), not O((M + N)·m). ``to_landmarks`` and ``from_landmarks`` are then
        not returned (``extra`` is None); ask for ``need_weights=True`` (or listen) to get them.
        """
        if mask is None and bias is None and not need_weights and self._fused(q, k, v):
            return self._fused_forward(q, k, v)
        return super().attend(q, k, v, mask=mask, bias=bias, need_weights=need_weights)

    def _fused(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether :meth:`attend` may take the fused path (the factors are this class's)."""
        m = self.num_landmarks
        own = type(self).score is NystromAttention.score and (
            type(self).landmarks is LandmarkAttention.landmarks
        )
        return (
            own
            and type(self.align) is Softmax
            and self.align.softmax_temperature() == 1.0
            and not hooks.listening()
            and all(isinstance(x, Tensor) and x.dtype in _FUSED_DTYPES for x in (q, k, v))
            and q.dtype == k.dtype == v.dtype
            and q.dim() >= 2
            and k.dim() >= 2
            and min(q.shape[-2], k.shape[-2]) >= m
        )

    def _fused_forward(self, q: Tensor, k: Tensor, v: Tensor) -> AttentionOutput:
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        (mq, d), n, dv = q.shape[-2:], k.shape[-2], v.shape[-1]
        q, k = q.expand(*lead, mq, d), k.expand(*lead, n, d)
        ql, _, kl, _ = self.landmarks(q, k, None, None)
        z = self.pseudo_inverse(torch.softmax(self.score(ql, kl), -1))

        def four(x: Tensor) -> Tensor:  # (1, Z, L, e): the fused kernel's layout
            return x.reshape(1, -1, *x.shape[-2:])

        values = F.scaled_dot_product_attention(four(ql), four(k), four(v.expand(*lead, n, dv)))
        inner = z @ values.view(*lead, ql.shape[-2], dv)  # Z (B V) (…, m, d_v)
        context = F.scaled_dot_product_attention(four(q), four(kl), four(inner))
        return AttentionOutput(context.view(*lead, mq, dv))

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (31, 32, 33))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(3), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.GLOBAL]
