"""Alternating co-attention guided by an external query (Sordoni et al. 2016; Galassi IV-D2).

Lu et al.'s alternating co-attention (:class:`attnkit.features.AlternatingCoAttention`) attends
F1 without a query, then F2 with F1's context, then F1 again. Sordoni et al.'s iterative
alternating attention "omitted the last step and factor[ed] in an additional query element q in
the first two attention steps" (Galassi IV-D2a): with an external query q (B, d_q) — in Sordoni
et al. the search state of the inference GRU —

    c⁽¹⁾ = Σ_i a⁽¹⁾_i f⁽¹⁾_i,  a⁽¹⁾ = softmax(score1(q, F1))            (question glimpse)
    c⁽²⁾ = Σ_j a⁽²⁾_j f⁽²⁾_j,  a⁽²⁾ = softmax(score2([q; c⁽¹⁾], F2))    (document glimpse)

Both scores default to Sordoni et al.'s biased general score kᵀ(W q + b).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import attend_one
from attnkit.features.coattention import CoAttentionOutput, co_inputs
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import BiasedGeneral, Score

__all__ = ["QueryGuidedCoAttention"]


@REGISTRY.register("query_guided_co_attention")
class QueryGuidedCoAttention(nn.Module):
    """Alternating co-attention with an external query (Sordoni et al. 2016).

    Args:
        d1, d2: feature sizes of F1 (attended first, e.g. the question) and F2 (the document).
        d_q: size of the external query q.
        score1: scores F1 against q (d_q → d1); default biased general.
        score2: scores F2 against [q; c⁽¹⁾] (d_q + d1 → d2); default biased general.
        align: the alignment of both steps.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask1": ("f1",), "mask2": ("f2",)}

    def __init__(
        self,
        d1: int,
        d2: int,
        d_q: int,
        *,
        score1: Score | None = None,
        score2: Score | None = None,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2, d_q=d_q)
        self.d1, self.d2, self.d_q = d1, d2, d_q
        kw = {"device": device, "dtype": dtype}
        first = checks.optional_score(score1, "score1") or BiasedGeneral(d_q, d1, **kw)
        second = checks.optional_score(score2, "score2") or BiasedGeneral(d_q + d1, d2, **kw)
        self.att1 = Attention(first, align)
        self.att2 = Attention(second, align)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        f1, f2 = example_tensor(2, 5, 6, seed=1), example_tensor(2, 4, 3, seed=2)
        query = example_tensor(2, 4, seed=3)
        kwargs = {
            "mask1": masks.from_lengths(torch.tensor([5, 3]), 5),
            "mask2": masks.from_lengths(torch.tensor([2, 4]), 4),
        }
        return cls(6, 3, 4), (f1, f2, query), kwargs

    def taxonomy_tags(self) -> list:
        return [tx.FeatureMultiplicity.ALTERNATING_CO_ATTENTION, tx.QueryType.SPECIALIZED]

    def forward(
        self,
        f1: Tensor,
        f2: Tensor,
        query: Tensor,
        mask1: Tensor | None = None,
        mask2: Tensor | None = None,
    ) -> CoAttentionOutput:
        """f1 (B, n1, d1), f2 (B, n2, d2), query (B, d_q); mask1 (B, n1) or (B, 1, n1) and
        mask2 (B, n2) or (B, 1, n2) boolean, True = a real feature (None: all real)."""
        f1, f2, mask1, mask2 = co_inputs(self, f1, f2, mask1, mask2, self.d1, self.d2)
        query = checks.features(query, "query", self.d_q, what="d_q", rank=2)
        checks.same_batch(("f1", f1), ("query", query))
        c1, a1 = attend_one(self.att1, query, f1, mask1)  # question glimpse
        c2, a2 = attend_one(self.att2, torch.cat([query, c1], -1), f2, mask2)  # document glimpse
        return CoAttentionOutput(c1, c2, a1, a2)
