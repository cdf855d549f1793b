"""Aggregation functions of fine-grained co-attention (Galassi IV-D2, Table V): from the affinity
(co-attention) matrix A (B, n1, n2) to energy scores e⁽¹⁾ (B, n1) over F1 and e⁽²⁾ (B, n2) over
F2. Pass one as ``score=`` to :class:`attnkit.features.ParallelCoAttention`; the pooling (eq. 16)
and perceptron (Lu et al., Brauwers eqs. 14-15) aggregations are built in there.

Each is called as ``aggregate(A, f1, f2, mask1, mask2)`` with f1 (B, n1, d1), f2 (B, n2, d2) and
boolean feature masks (B, n1), (B, n2) or None (True = a real feature); padded pairs take no
part in any sum.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.arguments import sizes
from attnkit.layers import HeadwiseLinear

__all__ = ["LinearAggregation", "NestedPerceptronAggregation"]


def _pair_mask(a: Tensor, mask1: Tensor | None, mask2: Tensor | None) -> Tensor | None:
    """(B, n1, n2) True where both features are real, or None without masks."""
    if mask1 is None and mask2 is None:
        return None
    m1 = torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device) if mask1 is None else mask1
    m2 = (
        torch.ones((*a.shape[:-2], a.shape[-1]), dtype=torch.bool, device=a.device)
        if mask2 is None
        else mask2
    )
    return m1.unsqueeze(-1) & m2.unsqueeze(-2)


def _softmax(a: Tensor, mask: Tensor | None, dim: int) -> Tensor:
    """Softmax along ``dim`` over the unmasked entries; a row with none gives zeros."""
    if mask is None:
        return a.softmax(dim)
    w = a.masked_fill(~mask, float("-inf")).softmax(dim)
    return torch.where(mask.any(dim, keepdim=True), w, torch.zeros((), dtype=a.dtype))


class LinearAggregation(nn.Module):
    """Energy scores as a linear transformation of the affinity matrix (Galassi Table V, [127]):
    e⁽¹⁾ = A (F2 w_2), e⁽²⁾ = Aᵀ (F1 w_1), i.e. e⁽¹⁾_i = Σ_j A_ij (w_2ᵀ f⁽²⁾_j).

    The weight of each column of A is read from its feature (w_2ᵀ f⁽²⁾_j), so the map applies to
    inputs of any length and permuting F2 permutes nothing in e⁽¹⁾ (our reading: the survey's
    table does not fix how the linear map is sized).
    """

    def __init__(
        self,
        d1: int,
        d2: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2)
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.w1 = HeadwiseLinear(d1, 1, **kw)
        self.w2 = HeadwiseLinear(d2, 1, **kw)

    def forward(
        self, a: Tensor, f1: Tensor, f2: Tensor, mask1: Tensor | None, mask2: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        pair = _pair_mask(a, mask1, mask2)
        if pair is not None:
            a = a * pair
        e1 = (a @ self.w2(f2)).squeeze(-1)
        e2 = (a.transpose(-1, -2) @ self.w1(f1)).squeeze(-1)
        return e1, e2


class NestedPerceptronAggregation(nn.Module):
    """Nested aggregation through a perceptron (Nie et al.; Galassi IV-D2: "M1 and M2 are fed to
    a multilayer perceptron, as is done by Lu et al.").

    M1 = row-wise softmax of A (each F1 feature over F2), M2 = column-wise softmax (each F2
    feature over F1), then Lu et al.'s perceptron (Brauwers eqs. 14-15) with M1 and M2 in place
    of A: e⁽¹⁾ = w_1ᵀ tanh(W_1 F1 + M1 W_2 F2), e⁽²⁾ = w_2ᵀ tanh(W_2 F2 + M2ᵀ W_1 F1).
    """

    def __init__(
        self,
        d1: int,
        d2: int,
        d_w: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2, d_w=d_w)
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.W1 = HeadwiseLinear(d1, d_w, **kw)
        self.W2 = HeadwiseLinear(d2, d_w, **kw)
        self.w1 = HeadwiseLinear(d_w, 1, **kw)
        self.w2 = HeadwiseLinear(d_w, 1, **kw)

    def forward(
        self, a: Tensor, f1: Tensor, f2: Tensor, mask1: Tensor | None, mask2: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        pair = _pair_mask(a, mask1, mask2)
        m1 = _softmax(a, pair, -1)  # (B, n1, n2), rows over F2
        m2 = _softmax(a, pair, -2)  # (B, n1, n2), columns over F1
        h1, h2 = self.W1(f1), self.W2(f2)
        e1 = self.w1(torch.tanh(h1 + m1 @ h2)).squeeze(-1)
        e2 = self.w2(torch.tanh(h2 + m2.transpose(-1, -2) @ h1)).squeeze(-1)
        return e1, e2
