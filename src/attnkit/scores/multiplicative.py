"""Multiplicative score functions (Brauwers Table II): dot, scaled dot, general, biased general,
activated general."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.layers import HeadwiseLinear, resolve_activation
from attnkit.scores.base import REGISTRY, Score, expect_features

__all__ = ["ActivatedGeneral", "BiasedGeneral", "Dot", "FixedScaleDot", "General", "ScaledDot"]


def _qk(qp: Tensor, kp: Tensor) -> Tensor:
    """ "...md,...nd->...mn" with broadcasting of the leading dims."""
    return torch.matmul(qp, kp.transpose(-1, -2))


@REGISTRY.register("dot")
class Dot(Score):
    """Multiplicative (Luong) score: e_l = qᵀ k_l (Brauwers Table II). Needs d_q = d_k.

    Args:
        softcap: c > 0 caps the scores smoothly to (−c, c): e ↦ c·tanh(e / c) (logit
            soft-capping, Gemma Team 2024, "Gemma 2", sec. 2; the same as the ``score_mod``
            ``lambda e, b, h, q_idx, kv_idx: c * torch.tanh(e / c)``). None (default): no cap.
            A capped score is no longer a scaled dot product, so SDPA does not evaluate it.
    """

    scoring = tx.Scoring.MULTIPLICATIVE

    def __init__(self, softcap: float | None = None) -> None:
        super().__init__()
        self.softcap = (
            None if softcap is None else arguments.finite_float(softcap, "softcap", positive=True)
        )

    @property
    def dot_product_form(self) -> bool:  # type: ignore[override]
        return self.softcap is None

    def scale(self, d_k: int) -> float:
        return 1.0

    def _cap(self, e: Tensor) -> Tensor:
        return e if self.softcap is None else self.softcap * torch.tanh(e / self.softcap)

    def check(self, q: Tensor | None, k: Tensor) -> None:
        assert q is not None  # guaranteed by Score.forward
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"{type(self).__name__} score needs d_q == d_k, got q {tuple(q.shape)} "
                f"and k {tuple(k.shape)}"
            )

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        assert qp is not None
        return self._cap(_qk(qp, kp) * self.scale(kp.shape[-1]))

    def extra_repr(self) -> str:
        return "" if self.softcap is None else f"softcap={self.softcap:g}"

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        assert q is not None
        if self.softcap is not None:
            raise NotImplementedError(f"{type(self).__name__} with softcap is not a dot product")
        self.check(q, k)
        return q, k, self.scale(k.shape[-1])


class FixedScaleDot(Dot):
    """Scaled multiplicative score with a fixed scale: e_l = s · qᵀ k_l (Brauwers Table II,
    scaled dot product, with s given rather than 1/√d_k). For parts whose scale does not follow
    the query's size: multi-head latent attention scales by 1/√(d_h + d_h^R) whatever the
    absorbed queries' size, and a transformers model has its own ``scaling``. Not registered:
    it needs its scale, which no size gives.

    Args:
        scale: s, a finite number > 0.
    """

    scoring = tx.Scoring.SCALED_MULTIPLICATIVE

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fixed_scale = arguments.finite_float(scale, "scale", positive=True)

    def scale(self, d_k: int) -> float:
        return self.fixed_scale

    def extra_repr(self) -> str:
        return f"scale={self.fixed_scale:g}"


@REGISTRY.register("scaled_dot")
class ScaledDot(Dot):
    """Scaled multiplicative (Vaswani) score: e_l = qᵀ k_l / √d_k (Brauwers Table II); with
    ``softcap`` c, e_l = c·tanh(qᵀ k_l / (c √d_k)) (Gemma 2's attention logit soft-capping)."""

    scoring = tx.Scoring.SCALED_MULTIPLICATIVE

    def scale(self, d_k: int) -> float:
        return 1.0 / math.sqrt(d_k)


class _QueryMapped(Score):
    """Shared body of the general family: the query is mapped into key space by W (d_k × d_q)."""

    def __init__(
        self,
        d_q: int,
        d_k: int,
        *,
        bias: bool,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_q = arguments.positive_int(d_q, "d_q")
        self.d_k = arguments.positive_int(d_k, "d_k")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        self.W = HeadwiseLinear(
            d_q, d_k, num_heads=num_heads, bias=bias, device=device, dtype=dtype
        )

    # for_heads: d_q = d_k = head_dim, one parameter set per head.
    size_arguments: ClassVar[dict[str, str]] = {
        "d_q": "head_dim", "d_k": "head_dim", "num_heads": "num_heads"
    }  # fmt: skip

    def check(self, q: Tensor | None, k: Tensor) -> None:
        assert q is not None
        expect_features(q, self.d_q, "q", "d_q")
        expect_features(k, self.d_k, "k", "d_k")

    def project_query(self, q: Tensor | None) -> Tensor | None:
        assert q is not None
        return self.W(q)

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        assert qp is not None
        return _qk(qp, kp)


@REGISTRY.register("general")
@arguments.renamed(heads="num_heads")
class General(_QueryMapped):
    """General (Luong) score: e_l = k_lᵀ W q, W ∈ R^{d_k×d_q} (Brauwers Table II)."""

    scoring = tx.Scoring.GENERAL
    dot_product_form: ClassVar[bool] = True
    _bias: ClassVar[bool] = False

    def __init__(
        self,
        d_q: int,
        d_k: int,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_q, d_k, bias=self._bias, num_heads=num_heads, device=device, dtype=dtype)

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        self.check(q, k)
        qp = self.project_query(q)
        assert qp is not None
        return qp, k, 1.0


@REGISTRY.register("biased_general")
class BiasedGeneral(General):
    """Biased general (Sordoni) score: e_l = k_lᵀ (W q + b), b ∈ R^{d_k} (Brauwers Table II)."""

    scoring = tx.Scoring.BIASED_GENERAL
    _bias: ClassVar[bool] = True


@REGISTRY.register("activated_general")
@arguments.renamed(heads="num_heads")
class ActivatedGeneral(_QueryMapped):
    """Activated general (Ma) score: e_l = act(k_lᵀ W q + b), scalar b (Brauwers Table II)."""

    scoring = tx.Scoring.ACTIVATED_GENERAL

    def __init__(
        self,
        d_q: int,
        d_k: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "tanh",
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_q, d_k, bias=False, num_heads=num_heads, device=device, dtype=dtype)
        self.act = resolve_activation(activation)
        shape = () if num_heads is None else (num_heads, 1, 1)
        self.b = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        return self.act(super().pairwise(qp, kp, key_offset) + self.b)
