"""Softmax with a temperature predicted from the query (Lin et al. 2018, self-adaptive
attention temperature; Galassi IV-C): softer or harder attention as each query needs."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments, inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, centered, masked_softmax
from attnkit.layers import HeadwiseLinear
from attnkit.sizing import example_sizes

__all__ = ["QueryTemperature", "check_query"]


def check_query(query: object, weight: Tensor, what: str) -> Tensor:
    """The query (…, M, d_q) of an alignment with a predictor of input size weight.shape[−1]."""
    if query is None:
        raise ValueError(f"{what} needs the query (…, M, d_q); got query=None")
    d_q = weight.shape[-1]
    if not isinstance(query, Tensor) or query.shape[-1] != d_q:
        shape = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise ValueError(f"{what}: query must be (…, M, d_q) with d_q = {d_q}, got {shape}")
    if query.dtype != weight.dtype or query.device != weight.device:
        raise TypeError(
            f"query is {query.dtype} on {query.device} but the {what} predictor is "
            f"{weight.dtype} on {weight.device}; convert one of them (alignment.to(...))"
        )
    return query


@REGISTRY.register("query_temperature")
@arguments.renamed(heads="num_heads")
class QueryTemperature(Alignment):
    """a = softmax(e / τ(q)), τ(q) = λ^{tanh(wᵀq + b)} ∈ (1/λ, λ) (Lin et al. 2018, eq. τ = λ^β).

    Lin et al. predict β from the decoder state and the previous context; here β comes from the
    query, which carries them in the general model (Brauwers eq. 2). A larger τ spreads the
    weights, a smaller one sharpens them.

    Args:
        d_q: the query size.
        base: λ > 1, the bound of the temperature.
        num_heads: one predictor per attention head (query (…, H, M, d_q)).
        device, dtype: of the predictor.
    """

    label = tx.AlignmentKind.GLOBAL

    # for_heads: the predictor reads queries of head_dim features, one per head.
    size_arguments: ClassVar[dict[str, str]] = {"d_q": "head_dim", "num_heads": "num_heads"}

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        """base = 3."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), base=3.0)

    def __init__(
        self,
        d_q: int,
        base: float = 2.0,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d_q, "d_q")
        if isinstance(base, bool) or not isinstance(base, (int, float)):
            raise TypeError(f"base must be a number > 1, got {base!r}")
        if not (base > 1 and math.isfinite(base)):
            raise ValueError(f"base must be finite and > 1, got {base!r}")
        self.base = float(base)
        self.predictor = HeadwiseLinear(d_q, 1, num_heads=num_heads, device=device, dtype=dtype)

    def temperature(self, query: Tensor) -> Tensor:
        """τ (…, M, 1) for the query (…, M, d_q)."""
        query = check_query(query, self.predictor.weight, "query_temperature")
        beta = torch.tanh(self.predictor(query))
        return torch.exp(beta * math.log(self.base))

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        """Weights (…, M, N) from scores (…, M, N) and the query (…, M, d_q)."""
        scores = inputs.alignment_inputs(self, scores, mask)
        tau = self.temperature(query).to(scores.dtype)  # type: ignore[arg-type]
        return AlignOutput(masked_softmax(centered(scores, mask) / tau, mask))
