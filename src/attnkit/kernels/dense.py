"""Dense evaluation: the full score matrix, then alignment, then the weighted sum (Brauwers
eqs. 2-4; multi-dimensional eqs. 30-32). The reference every faster path is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.kernels.base import Call, Kernel, guarded_sum, register
from attnkit.kernels.block_mask import BlockMask, ScoreMod, apply_score_mod
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["Dense", "attend"]


def _sum(a: Tensor, v: Tensor) -> Tensor:
    return torch.matmul(a, v)  # eq. 4


def _sum_multi(a: Tensor, v: Tensor) -> Tensor:
    return torch.einsum("...dmn,...nd->...md", a, v)  # eq. 30


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
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
    masked_finite: bool = False,
) -> AttentionOutput:
    """Evaluate attention densely; inputs are assumed validated.

    A ``block_mask`` is applied as its whole dense mask (combined with ``mask``) and
    ``score_mod`` on the whole score matrix: the reference for the block-sparse chunked kernel.

    For float16/bfloat16 inputs the scores are aligned in float32 (the bias is added there too)
    and the weighted sum accumulates in float32: half precision cannot hold a score plus a large
    bias, nor a normaliser. With a mask, a masked value that is NaN or infinite does not reach the
    context (it has weight 0, and 0·NaN would otherwise be NaN); ``masked_finite=True`` says that
    no masked value is (:attr:`attnkit.kernels.Call.masked_finite`), and the values are not
    looked at."""
    if block_mask is not None:
        pattern = block_mask.to_dense()
        mask = pattern if mask is None else mask & pattern
    # A score mixing neighbouring keys takes the mask itself (it must not read masked keys).
    masked = mask is not None and score.mixes_keys
    e = score(q, k, keep=mask) if masked else score(q, k)  # (…, M, N) or (…, M, N, d_v)
    dtype = v.dtype
    if e.dtype in (torch.float16, torch.bfloat16):
        e = e.float()
    multi = score.multi_dimensional
    if bias is not None:
        bias = bias.to(e.dtype)
        e = e + (bias.unsqueeze(-1) if multi else bias)
    if score_mod is not None:
        if multi:
            raise ValueError("score_mod applies to single-dimensional scores (…, M, N) only")
        e = apply_score_mod(score_mod, e)
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
    combine = _sum_multi if multi else _sum
    work = v.to(a.dtype) if a.dtype != dtype else v
    guard = mask is not None and not masked_finite and not torch.compiler.is_compiling()
    if guard and not bool(torch.isfinite(v).all()):
        context = guarded_sum(combine, a, work)
    else:
        context = combine(a, work)
    context = context.to(dtype)
    if multi:
        a = a.movedim(-3, -1)
        if log_prob is not None:
            log_prob = log_prob.movedim(-2, -1)
    if not need_weights:
        return AttentionOutput(context, log_prob=log_prob)
    return AttentionOutput(context, a.to(dtype), e.to(dtype), log_prob)


class Dense(Kernel):
    """The reference: evaluates every score × alignment, with dropout and every output."""

    name = "dense"
    priority = 0
    # Every capability of the base class: any dtype, device, score, alignment and argument
    # (a key-mixing score gets the whole mask); chunk_size belongs to the chunked kernel.

    def attend(self, call: Call) -> AttentionOutput:
        return attend(
            *call.parts(),
            mask=call.mask,
            bias=call.bias,
            need_weights=call.need_weights,
            dropout=call.dropout,
            block_mask=call.block_mask,
            score_mod=call.score_mod,
            masked_finite=call.masked_finite,
        )


register(Dense())
