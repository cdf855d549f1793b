"""Dense evaluation: the full score matrix, then alignment, then the weighted sum (Brauwers
eqs. 2-4; multi-dimensional eqs. 30-32). The reference every faster path is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["attend"]


def attend(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    score: Score,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    dropout: float = 0.0,
) -> AttentionOutput:
    """Evaluate attention densely; inputs are assumed validated."""
    e = score(q, k)  # (…, M, N) or (…, M, N, d_v)
    multi = score.multi_dimensional
    if bias is not None:
        e = e + (bias.unsqueeze(-1) if multi else bias)
    if multi:
        # Align each feature across keys (eq. 32): put features before (M, N).
        a, log_prob = align(
            e.movedim(-1, -3),
            None if mask is None else mask.unsqueeze(-3),
            query=None if q is None else q.unsqueeze(-3),
        )
    else:
        a, log_prob = align(e, mask, query=q)
    if dropout > 0.0:
        a = F.dropout(a, p=dropout, training=True)
    if multi:
        context = torch.einsum("...dmn,...nd->...md", a, v)  # eq. 30
        a = a.movedim(-3, -1)
        if log_prob is not None:
            log_prob = log_prob.movedim(-2, -1)
    else:
        context = torch.matmul(a, v)  # eq. 4
    if not need_weights:
        return AttentionOutput(context, log_prob=log_prob)
    return AttentionOutput(context, a, e, log_prob)
