"""Dispatch to ``torch.nn.functional.scaled_dot_product_attention`` when it computes the same
thing: a score in dot-product form, plain softmax alignment, and no weights requested."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.alignments import Alignment, Softmax
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["attend", "can_dispatch"]


def can_dispatch(score: Score, align: Alignment, *, need_weights: bool) -> bool:
    """Whether SDPA computes exactly this attention."""
    return (
        not need_weights
        and score.dot_product_form
        and not score.multi_dimensional
        and isinstance(align, Softmax)
        and not align.log_temperature.requires_grad
    )


def attend(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    score: Score,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    dropout: float = 0.0,
) -> AttentionOutput:
    """Evaluate with SDPA; the caller has checked :func:`can_dispatch`."""
    assert isinstance(align, Softmax)
    qp, kp, scale = score.dot_form(q, k)
    # softmax((scale·q'ᵀk' + bias) / τ): fold 1/τ into the scale and the bias.
    inv_t = 1.0 / float(align.temperature)
    scale = scale * inv_t
    lead = torch.broadcast_shapes(qp.shape[:-2], kp.shape[:-2], v.shape[:-2])
    qp = qp.expand(*lead, *qp.shape[-2:])
    kp = kp.expand(*lead, *kp.shape[-2:])
    v = v.expand(*lead, *v.shape[-2:])
    attn_mask: Tensor | None = mask
    if bias is not None:
        attn_mask = bias.to(qp.dtype) if inv_t == 1.0 else bias.to(qp.dtype) * inv_t
        if mask is not None:
            attn_mask = torch.where(mask, attn_mask, float("-inf"))
    context = F.scaled_dot_product_attention(
        qp, kp, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale
    )
    return AttentionOutput(context)
