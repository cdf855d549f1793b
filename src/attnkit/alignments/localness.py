"""Localness with a predicted centre and window (Yang et al. 2018, "Modeling Localness for
Self-Attention Networks"; Galassi IV-C): a Gaussian bias whose mean and variance both come from
the query."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments, inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, centered, masked_softmax
from attnkit.alignments.temperature import check_query
from attnkit.layers import HeadwiseLinear
from attnkit.sizing import example_sizes

__all__ = ["PredictedWindow"]


@REGISTRY.register("predicted_window")
@arguments.renamed(heads="num_heads")
class PredictedWindow(Alignment):
    """a_i = softmax(e_i + G_i), G_ij = −(j − P_i)² / (2σ_i²), σ_i = D_i / 2 (Yang et al. eq. 6).

    The centre and the window size are predicted from the query q_i (Yang et al. eqs. 7-9):
    p_i = U_pᵀ tanh(W_p q_i), z_i = U_dᵀ tanh(W_p q_i) (W_p shared), and
    P_i = I·sigmoid(p_i), D_i = I·sigmoid(z_i), with I the number of keys the row may attend
    (keys counted from 0). Unlike Luong's local-p (:class:`Local`), nothing is cut off: every
    key keeps a weight and both P and D are trained through the bias.

    Args:
        d_q: the query size; d_p: the hidden size of W_p (default d_q).
        num_heads: one predictor per attention head (query (…, H, M, d_q)).
        device, dtype: of the predictors.
    """

    position_based: ClassVar[bool] = True
    label = tx.AlignmentKind.LOCAL

    # for_heads: the predictor reads queries of head_dim features, one per head.
    size_arguments: ClassVar[dict[str, str]] = {"d_q": "head_dim", "num_heads": "num_heads"}

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        """A hidden layer of 3."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), d_p=3)

    def __init__(
        self,
        d_q: int,
        d_p: int | None = None,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d_q, "d_q")
        d_p = d_q if d_p is None else arguments.positive_int(d_p, "d_p")
        kw = {"num_heads": num_heads, "device": device, "dtype": dtype}
        self.W_p = HeadwiseLinear(d_q, d_p, bias=False, **kw)
        self.U = HeadwiseLinear(d_p, 2, bias=False, **kw)  # rows: U_p, U_d

    def centre_and_width(
        self, scores: Tensor, mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor, Tensor]:
        """P and D for every row, each (…, M, 1), in the scores' dtype."""
        query = check_query(query, self.W_p.weight, "predicted_window")
        if mask is None:
            count = torch.tensor(float(scores.shape[-1]), dtype=scores.dtype, device=scores.device)
        else:
            count = mask.sum(dim=-1, keepdim=True).to(scores.dtype)
        gates = torch.sigmoid(self.U(torch.tanh(self.W_p(query)))).to(scores.dtype)
        return count * gates[..., :1], count * gates[..., 1:]

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        """Weights (…, M, N) from scores (…, M, N) and the query (…, M, d_q)."""
        scores = inputs.alignment_inputs(self, scores, mask)
        centre, width = self.centre_and_width(scores, mask, query)  # type: ignore[arg-type]
        j = torch.arange(scores.shape[-1], device=scores.device, dtype=scores.dtype)
        sigma = (width / 2).clamp_min(torch.finfo(scores.dtype).tiny ** 0.25)
        bias = -((j - centre) ** 2) / (2 * sigma**2)
        return AlignOutput(masked_softmax(centered(scores, mask) + bias, mask))
