"""Chunked (memory-efficient) exact attention for every score and every streaming alignment.

FlashAttention's idea (Wikipedia, "FlashAttention"), for any score, not only dot products: the
queries and keys are processed in blocks, so no (M, N, d_w) tensor of an additive score and no
(M, N) weight matrix is ever held whole. Peak memory is O(block_q·block_k·d_w + (M + N)·d).

The kernel knows nothing of particular alignments: it reads the streaming protocol
(:mod:`attnkit.alignments.streaming`). A per-row statistic comes from sweeps over the key blocks
(or one sweep with running rescaling, for alignments that offer it, such as online softmax),
then each block's weights from its scores and the statistic. Statistics and sums are kept in
float32 for float16/bfloat16 inputs (float64 for float64).

The backward pass recomputes each block's scores from the saved per-row statistics and returns
gradients for q, k, v, the bias and every parameter of the score and alignment (via
``torch.autograd.grad`` on the block), so training needs no more memory than inference.

The kernel has two paths (:mod:`attnkit.kernels.paths`), and takes the first that serves a call:
:class:`Fused`, for block-sparse dot-product softmax attention with a constant temperature on
float32/float64 CPU tensors with d_v equal to the queries' and keys' features, when only q, k and
v need gradients (or none does): PyTorch's fused CPU kernel evaluates the pieces of each group of
query blocks, merged by their log-sum-exp, and its backward gives each piece's share of the
gradients from the merged context and log-sum-exp (:mod:`~attnkit.kernels.chunked.fused`); and
:class:`Tiled`, the general path, for every call the kernel supports.

Modules, one concept each: :mod:`~attnkit.kernels.chunked.plan` (block sizes, the keys of a tile,
the grouping of a block mask's query blocks), :mod:`~attnkit.kernels.chunked.streaming` (the
tiled forward and backward), :mod:`~attnkit.kernels.chunked.forms` (what form a score_mod has:
declared, or read from the function as a fallback), :mod:`~attnkit.kernels.chunked.schedule` (the
fused path's pieces of a block mask), :mod:`~attnkit.kernels.chunked.fused` (the fused CPU path)
and :mod:`~attnkit.kernels.chunked.evaluate` (the two paths and the evaluation of a call).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.kernels.base import Call, Kernel, get, register
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kernels.chunked.evaluate import Fused, Tiled, rank2, sizes
from attnkit.kernels.chunked.plan import (
    TILE_ELEMENTS,
    WIDE_TILE_ELEMENTS,
    default_chunk_size,
    reasons_not_streamable,
    supports,
    tile_width,
)
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = [
    "DENSE_LIMIT",
    "TILE_ELEMENTS",
    "WIDE_TILE_ELEMENTS",
    "Chunked",
    "Fused",
    "Tiled",
    "attend",
    "default_chunk_size",
    "reasons_not_streamable",
    "supports",
    "tile_width",
]

# Automatic selection evaluates in chunks above this many elements in the dense score tensor(s)
# (B·…·M·N·d_w), when the alignment streams: 2^24 float32 elements = 64 MiB.
DENSE_LIMIT = 1 << 24


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
    chunk_size: int | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
    finite: bool = False,
) -> AttentionOutput:
    """Evaluate attention block by block; inputs are assumed validated.

    ``chunk_size`` is the key block size (default :func:`default_chunk_size`); query blocks are
    sized so that a score tile holds about 2¹⁹ elements (2²¹ for wide scores such as
    additive). A ``block_mask`` sets both block sizes, and tiles it marks empty are skipped,
    forward and backward. ``score_mod(e, b, h, q_idx, kv_idx)`` modifies each tile's scores
    (after the bias), differentiably; an ``nn.Module`` score_mod's parameters get gradients.
    With ``need_weights`` the weights and scores are recomputed block by block into (…, M, N)
    tensors, without gradient. ``finite=True`` says the caller knows every value the mask
    leaves in is finite and the masked ones are zero (the call's ``masked_finite``), so the
    values are not scanned for the guarded path.

    The call is evaluated on the kernel's first path that serves it (the fused block-sparse
    path, then the tiled one; :mod:`attnkit.kernels.paths`).
    """
    reasons = reasons_not_streamable(align)
    if reasons:
        raise ValueError("chunked evaluation: " + "; ".join(reasons))
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if score_mod is not None and score.multi_dimensional:
        raise ValueError("score_mod applies to single-dimensional scores (…, M, N) only")
    if score.mixes_keys and (mask is not None or block_mask is not None):
        raise ValueError(
            f"chunked evaluation: score {type(score).__name__} mixes neighbouring keys and must "
            "see the whole mask at once; evaluate it with the dense kernel"
        )
    if block_mask is not None and chunk_size is not None and chunk_size != block_mask.block_k:
        raise ValueError(
            f"chunk_size={chunk_size} differs from the block mask's key block "
            f"{block_mask.block_k}; leave chunk_size out"
        )
    mask, bias = rank2(mask), rank2(bias)
    lead, m, n = sizes(q, k, v, mask, bias)
    call = Call(
        q,
        k,
        v,
        score,
        align,
        torch.Size((*lead, m, n)),
        mask=mask,
        bias=bias,
        need_weights=need_weights,
        chunk_size=chunk_size,
        block_mask=block_mask,
        score_mod=score_mod,
        masked_finite=finite,
    )
    path = get("chunked").choose_path(call)
    assert path is not None
    return path.attend(call)


class Chunked(Kernel):
    """Exact attention in key and query blocks, for every score and streaming alignment."""

    name = "chunked"
    priority = 20
    needs_streaming_alignment = True
    masks_key_mixing_scores = False  # a tile sees its own keys only
    accepts_dropout = False
    accepts_chunk_size = True
    preference = (
        "for a block mask, or when the dense score tensor (B·…·M·N·d_w elements) would "
        "exceed DENSE_LIMIT"
    )
    paths = (Fused(), Tiled())

    def prefers(self, call: Call) -> bool:
        if call.block_mask is not None:
            return True  # its cost follows the pattern's density
        return call.shape.numel() * tile_width(call.score) > DENSE_LIMIT

    def attend(self, call: Call) -> AttentionOutput:
        return attend(
            *call.parts(),
            mask=call.mask,
            bias=call.bias,
            need_weights=call.need_weights,
            chunk_size=call.chunk_size,
            block_mask=call.block_mask,
            score_mod=call.score_mod,
            finite=call.masked_finite,
        )


register(Chunked())
