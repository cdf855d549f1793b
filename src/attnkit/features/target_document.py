"""Target-then-document attention (Ma et al. 2018; Galassi IV-A2, Fig. 6 right).

A *target* — a set of words of the document (an aspect, an entity), not necessarily contiguous —
is attended first, as keys K_T with no query, giving its context c_T; c_T is then the query of
attention over the document's words K_W, giving the document's context c:

    c_T = Σ_t a⁽ᵀ⁾_t k⁽ᵀ⁾_t,  a⁽ᵀ⁾ = softmax(score_T(K_T))          (self-attentive)
    c   = Σ_i a_i k⁽ᵂ⁾_i,    a   = softmax(score_W(c_T, K_W))
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import attend_one
from attnkit.features.coattention import co_inputs
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive, Score

__all__ = ["TargetDocumentAttention", "TargetDocumentOutput"]


class TargetDocumentOutput(NamedTuple):
    """context c (B, d_w), target context c_T (B, d_t), target weights (B, n_t), document
    weights (B, n_w)."""

    context: Tensor
    target_context: Tensor
    target_weights: Tensor
    document_weights: Tensor

    @property
    def representation(self) -> Tensor:
        """The document's context c (B, d_w), guided by the target."""
        return self.context

    def named_weights(self) -> dict[str, Tensor]:
        return {"target_weights": self.target_weights, "document_weights": self.document_weights}


@REGISTRY.register("target_document_attention")
class TargetDocumentAttention(nn.Module):
    """Target-then-document attention (Ma et al.; Galassi IV-A2).

    Args:
        d_t: feature size of the target words K_T.
        d_w: feature size of the document words K_W.
        d_hidden: hidden size of the default additive scores.
        target_score: a query-free score over K_T (default additive, wᵀ tanh(W k + b)).
        document_score: scores K_W against c_T (d_t → d_w; default additive).
        align: the alignment of both steps.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {
        "target_mask": ("target",),
        "document_mask": ("document",),
    }

    def __init__(
        self,
        d_t: int,
        d_w: int,
        d_hidden: int = 64,
        *,
        target_score: Score | None = None,
        document_score: Score | None = None,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_t=d_t, d_w=d_w, d_hidden=d_hidden)
        self.d_t, self.d_w = d_t, d_w
        kw = {"device": device, "dtype": dtype}
        first = checks.optional_score(target_score, "target_score")
        if first is not None and not first.query_free:
            raise ValueError(
                f"target_score must be query-free (the target is attended first, with no "
                f"query), got {type(first).__name__}"
            )
        self.target_attention = Attention(first or Additive(None, d_t, d_hidden, **kw), align)
        second = checks.optional_score(document_score, "document_score")
        self.document_attention = Attention(second or Additive(d_t, d_w, d_hidden, **kw), align)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        target, document = example_tensor(2, 3, 4, seed=1), example_tensor(2, 5, 4, seed=2)
        kwargs = {
            "target_mask": masks.from_lengths(torch.tensor([3, 1]), 3),
            "document_mask": masks.from_lengths(torch.tensor([4, 5]), 5),
        }
        return cls(4, 4, 5), (target, document), kwargs

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED]

    def forward(
        self,
        target: Tensor,
        document: Tensor,
        target_mask: Tensor | None = None,
        document_mask: Tensor | None = None,
    ) -> TargetDocumentOutput:
        """target (B, n_t, d_t), document (B, n_w, d_w); masks (B, n) or (B, 1, n) boolean,
        True = a real word (None: all real)."""
        target, document, target_mask, document_mask = co_inputs(
            self, target, document, target_mask, document_mask, self.d_t, self.d_w
        )
        c_t, a_t = attend_one(self.target_attention, None, target, target_mask)
        c, a = attend_one(self.document_attention, c_t, document, document_mask)
        return TargetDocumentOutput(c, c_t, a_t, a)
