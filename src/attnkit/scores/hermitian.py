"""Hermitian co-compatibility (Tay et al. 2018; Galassi IV-D2): queries and keys are embedded in
a complex space, compared by the Hermitian inner product, and only its real part is kept."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.layers import HeadwiseLinear
from attnkit.scores.base import REGISTRY, Score, expect_features

__all__ = ["Hermitian"]


@REGISTRY.register("hermitian")
class Hermitian(Score):
    """Hermitian score: e_l = Re⟨φ(q), φ(k_l)⟩ = Re Σ_c φ(q)_c · conj(φ(k_l)_c).

    φ(x) = W_re x + i·W_im x ∈ C^{d_w} is one complex embedding shared by queries and keys, so
    swapping the roles conjugates the product: ⟨φ(k), φ(q)⟩ = conj⟨φ(q), φ(k)⟩ — its real part
    (the score) is symmetric, its imaginary part antisymmetric (Galassi IV-D2: "the Hermitian
    product [is] noncommutative"; :meth:`hermitian` returns the full complex product).

    Re⟨φ(q), φ(k)⟩ = (W_re q)ᵀ(W_re k) + (W_im q)ᵀ(W_im k), so the score is in dot-product form
    with q' = [W_re q; W_im q] and k' = [W_re k; W_im k] (it may dispatch to SDPA).

    Args:
        d_k: feature size of the queries and of the keys (d_q = d_k: the embedding is shared).
        d_w: complex dimension of the embedding.
        heads: one (W_re, W_im) per head; inputs are then (B, …, H, L, d).
    """

    scoring = tx.Scoring.GENERAL
    dot_product_form: ClassVar[bool] = True

    def __init__(
        self,
        d_k: int,
        d_w: int,
        *,
        heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_k = arguments.positive_int(d_k, "d_k")
        self.d_w = arguments.positive_int(d_w, "d_w")
        self.heads = arguments.optional_positive_int(heads, "heads")
        kw = {"heads": heads, "bias": False, "device": device, "dtype": dtype}
        self.W_re = HeadwiseLinear(d_k, d_w, **kw)
        self.W_im = HeadwiseLinear(d_k, d_w, **kw)

    @classmethod
    def for_heads(cls, d: int, heads: int, **factory: Any) -> Score:
        """d_k = d_w = d, one embedding per head."""
        return cls(d, d, heads=heads, **factory)

    def check(self, q: Tensor | None, k: Tensor) -> None:
        assert q is not None
        expect_features(q, self.d_k, "q", "d_k (queries and keys share the embedding)")
        expect_features(k, self.d_k, "k", "d_k")

    def embed(self, x: Tensor) -> Tensor:
        """φ(x) (…, L, d_w), complex."""
        return torch.complex(self.W_re(x), self.W_im(x))

    def hermitian(self, q: Tensor, k: Tensor) -> Tensor:
        """The complex Hermitian products ⟨φ(q_m), φ(k_n)⟩ (…, M, N); the score is its real part."""
        self.check(q, k)
        return self.embed(q) @ self.embed(k).conj().transpose(-1, -2)

    def project_query(self, q: Tensor | None) -> Tensor | None:
        assert q is not None
        return torch.cat([self.W_re(q), self.W_im(q)], dim=-1)

    def project_key(self, k: Tensor) -> Tensor:
        return torch.cat([self.W_re(k), self.W_im(k)], dim=-1)

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        assert qp is not None
        return torch.matmul(qp, kp.transpose(-1, -2))

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        assert q is not None
        self.check(q, k)
        return self.project_query(q), self.project_key(k), 1.0  # type: ignore[return-value]
