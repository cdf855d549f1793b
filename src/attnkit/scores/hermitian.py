"""Hermitian co-compatibility (Tay et al. 2018; Galassi IV-D2): queries and keys are embedded in
a complex space, compared by the Hermitian inner product, and only its real part is kept.

With one shared embedding the real part is symmetric (:class:`Hermitian`); weighting the
product by a learned complex vector makes it depend on the roles (:class:`DirectedHermitian`)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.layers import HeadwiseLinear
from attnkit.scores.base import REGISTRY, Score, expect_features
from attnkit.sizing import example_sizes

__all__ = ["DirectedHermitian", "Hermitian"]


@REGISTRY.register("hermitian")
@arguments.renamed(heads="num_heads")
class Hermitian(Score):
    """Hermitian score: e_l = Re⟨φ(q), φ(k_l)⟩ = Re Σ_c φ(q)_c · conj(φ(k_l)_c).

    φ(x) = W_re x + i·W_im x ∈ C^{d_w} is one complex embedding shared by queries and keys, so
    swapping the roles conjugates the product: ⟨φ(k), φ(q)⟩ = conj⟨φ(q), φ(k)⟩ — its real part
    (the score) is symmetric, its imaginary part antisymmetric (Galassi IV-D2: "the Hermitian
    product [is] noncommutative"; :meth:`hermitian` returns the full complex product).
    :class:`DirectedHermitian` lets the imaginary part reach the score, so that the score
    depends on which input is the query.

    Re⟨φ(q), φ(k)⟩ = (W_re q)ᵀ(W_re k) + (W_im q)ᵀ(W_im k), so the score is in dot-product form
    with q' = [W_re q; W_im q] and k' = [W_re k; W_im k] (it may dispatch to SDPA).

    Args:
        d_k: feature size of the queries and of the keys (d_q = d_k: the embedding is shared).
        d_w: complex dimension of the embedding.
        num_heads: one (W_re, W_im) per head; inputs are then (B, …, H, L, d).
    """

    scoring = tx.Scoring.GENERAL
    dot_product_form: ClassVar[bool] = True

    def __init__(
        self,
        d_k: int,
        d_w: int,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_k = arguments.positive_int(d_k, "d_k")
        self.d_w = arguments.positive_int(d_w, "d_w")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        kw = {"num_heads": num_heads, "bias": False, "device": device, "dtype": dtype}
        self.W_re = HeadwiseLinear(d_k, d_w, **kw)
        self.W_im = HeadwiseLinear(d_k, d_w, **kw)

    # for_heads: d_k = d_w = head_dim, one embedding per head.
    size_arguments: ClassVar[dict[str, str]] = {
        "d_k": "head_dim", "d_w": "head_dim", "num_heads": "num_heads"
    }  # fmt: skip

    @classmethod
    def example(cls, **sizes: int | None) -> Score:
        """d_w = 5."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), d_w=5)

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


@REGISTRY.register("directed_hermitian")
@arguments.renamed(heads="num_heads")
class DirectedHermitian(Hermitian):
    """Role-dependent Hermitian score: e_l = Re Σ_c r_c · φ(q)_c · conj(φ(k_l)_c), r ∈ C^{d_w}
    learned (the complex relation vector of ComplEx, Trouillon et al. 2016, on which Tay et al.
    build the Hermitian co-attention).

    Galassi IV-D2: "Being the Hermitian product noncommutative, E will depend on the roles
    played by the inputs as keys and queries". With h_c = φ(q)_c conj(φ(k)_c),
    e = Σ_c Re(r_c) Re(h_c) − Im(r_c) Im(h_c); swapping the roles conjugates h, so the first
    sum is symmetric and the second antisymmetric: e(q, k) − e(k, q) = −2 Σ_c Im(r_c) Im(h_c),
    which is not zero once Im(r) ≠ 0. r = 1 gives :class:`Hermitian`.

    Dot-product form: with φ(q) = a + ib and r̄ φ(k) = c' + id', e = [a; b]ᵀ[c'; d'].
    Initialisation: Re(r) = 1, Im(r) uniform in (−1, 1) (the score starts role-dependent).

    Args:
        d_k: feature size of the queries and of the keys (the embedding φ is shared).
        d_w: complex dimension of the embedding.
        num_heads: one (W_re, W_im, r) per head; inputs are then (B, …, H, L, d).
    """

    def __init__(
        self,
        d_k: int,
        d_w: int,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_k, d_w, num_heads=num_heads, device=device, dtype=dtype)
        shape = (d_w,) if self.num_heads is None else (self.num_heads, 1, d_w)
        kw = {"device": device, "dtype": dtype}
        self.r_re = torch.nn.Parameter(torch.ones(shape, **kw))
        self.r_im = torch.nn.Parameter(torch.empty(shape, **kw).uniform_(-1.0, 1.0))

    def relation(self) -> Tensor:
        """r (d_w,) [(H, 1, d_w) with heads], complex."""
        return torch.complex(self.r_re, self.r_im)

    def hermitian(self, q: Tensor, k: Tensor) -> Tensor:
        """The complex weighted products Σ_c r_c φ(q_m)_c conj(φ(k_n)_c) (…, M, N); the score is
        their real part."""
        self.check(q, k)
        return (self.embed(q) * self.relation()) @ self.embed(k).conj().transpose(-1, -2)

    def project_key(self, k: Tensor) -> Tensor:
        c, d = self.W_re(k), self.W_im(k)
        r_re, r_im = self.r_re.to(c.dtype), self.r_im.to(c.dtype)
        return torch.cat([r_re * c + r_im * d, r_re * d - r_im * c], dim=-1)  # r̄ φ(k)
