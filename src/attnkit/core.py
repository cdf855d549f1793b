"""The general attention model (Brauwers Sec. 2, Fig. 2): score -> align -> weighted average.

:func:`attention` is the functional core; :class:`Attention` the module holding a score and an
alignment part.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from attnkit import checks, hooks, inputs, kernels, trust
from attnkit.alignments import Alignment
from attnkit.head import HeadAttention
from attnkit.kernels.base import Call
from attnkit.kernels.block_mask import BlockMask, ScoreMod, check_type, from_dense_auto
from attnkit.kernels.chunked import DENSE_LIMIT
from attnkit.output import AttentionOutput
from attnkit.scores import Score
from attnkit.scores.base import check_heads

__all__ = ["DENSE_LIMIT", "Attention", "AttentionOutput", "attention"]


def _all_finite(x: Tensor) -> bool:
    """Whether every element of ``x`` is finite: one reduction (a NaN or an infinity makes the
    sum non-finite; only a sum that overflows needs the element-wise look)."""
    x = x.detach()
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _dead_keys(mask: Tensor) -> Tensor:
    """(…, N, 1): True for the keys that no query row may attend (a mask of rank < 2 is the same
    for every row)."""
    keep = mask.any(dim=-2) if mask.dim() >= 2 else mask
    return ~keep.unsqueeze(-1) if keep.dim() else ~keep


def _zero_dead_keys(call: Call, k: bool = True, v: bool = True) -> Call:
    """The call with the keys and values that no query may attend set to zero."""
    dead = _dead_keys(call.mask)  # type: ignore[arg-type]
    zero = call.k.new_zeros(())
    return dataclasses.replace(
        call,
        k=torch.where(dead, zero, call.k) if k else call.k,
        v=torch.where(dead, zero, call.v) if v else call.v,
    )


def _exclude_masked(call: Call) -> Call:
    """The call whose masked keys and values cannot reach anything, with
    :attr:`Call.masked_finite` set where that is established (kernels then do not look).

    A masked position's content must not influence anything: not the scores of other keys, not
    the context (0·NaN is NaN), not the gradients. (A score that mixes neighbouring keys takes
    the mask itself and reads a masked key as zeros, per query row.) In order:

    - inputs stated finite by the door (``attnkit.trust.trusted(finite=True)``): nothing to do;
    - a mask the same for every query, (…, 1, N) — key padding, and every step of decoding —
      with no block mask and no weights asked for: the masked keys and values are set to zero
      by construction (one ``torch.where`` each; the values are not read on the host);
    - otherwise (masks that differ per query, or weights asked for, whose raw scores at masked
      positions are returned as they are): keys and values are looked at once; when one is not
      finite, the keys and values masked for every query are set to zero and the kernel guards
      the rest per row.
    """
    if call.mask is None or torch.compiler.is_compiling():
        return call  # (a data-dependent check would break a compiled graph)
    if trust.inputs_finite():
        return dataclasses.replace(call, masked_finite=True)
    per_key = call.mask.dim() < 2 or call.mask.shape[-2] == 1
    if per_key and call.block_mask is None and not call.need_weights:
        return dataclasses.replace(_zero_dead_keys(call), masked_finite=True)
    k_ok, v_ok = _all_finite(call.k), _all_finite(call.v)
    if k_ok and v_ok:
        return dataclasses.replace(call, masked_finite=True)
    return _zero_dead_keys(call, k=not k_ok, v=not v_ok)


def attention(
    q: Tensor | None,
    k: Tensor,
    v: Tensor | None = None,
    *,
    score: str | Score = "scaled_dot",
    align: str | Alignment = "softmax",
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    chunk_size: int | None = None,
    dropout: float = 0.0,
    kernel: str | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
) -> AttentionOutput:
    """General attention: e = score(q, k) (eq. 2), a = align(e) (eq. 3), c = Σ_l a_l v_l (eq. 4).

    Args:
        q: queries (B, …, M, d_q); None for query-free (self-attentive) scores, then M = 1.
        k: keys (B, …, N, d_k).
        v: values (B, …, N, d_v); None means v = k (as in RNNsearch).
        score: a registered name of a parameter-free score (``"dot"``, ``"scaled_dot"``,
            ``"cosine"``, ``"euclidean"``) or a :class:`attnkit.scores.Score` module.
        align: a registered name of a parameter-free alignment (``"softmax"``,
            ``"sparsemax"``, ``"entmax15"``, ``"sigmoid"``, ``"hard"``, …) or a module.
        mask: boolean, True = may attend, broadcastable to (B, …, M, N). A row with no key
            allowed gets weights 0 and context 0; a masked key's content (even NaN) has no
            influence.
        bias: float tensor added to the scores, broadcastable to (B, …, M, N).
        need_weights: also return the weights and the scores.
        chunk_size: key block size of the chunked kernel (selects it).
        dropout: dropout probability on the weights (apply only in training).
        kernel: a name from :func:`attnkit.kernels.available` to force a kernel (``"dense"``,
            ``"sdpa"``, ``"chunked"``); it raises with the kernel's reasons when it cannot
            evaluate the call. None chooses by priority: SDPA when the score is in dot-product
            form, the alignment softmax with a constant temperature and no weights are
            requested; chunked when the dense score tensor would exceed :data:`DENSE_LIMIT`
            elements and the alignment streams; dense otherwise.
        block_mask: a sparse pattern (:class:`attnkit.kernels.BlockMask`, e.g. from
            :mod:`attnkit.patterns`), combined with ``mask``: the chunked kernel then skips the
            tiles it leaves empty, so the cost follows the pattern's density.
        score_mod: ``score_mod(e, b, h, q_idx, kv_idx) -> e'`` applied to the scores (after the
            bias), differentiable; e.g. a relative-position bias or soft-capping.

    A dense boolean ``mask`` (…, M, N) on the CPU whose 128 × 128 tiles are mostly empty (at
    most 40 % hold an allowed pair, at least 8 tiles a side) is evaluated as a block mask when no
    kernel is forced and no weights are requested: the chunked kernel then skips its empty tiles
    (same result; see :func:`attnkit.kernels.block_mask.from_dense_auto`).

    Returns:
        :class:`AttentionOutput` (context, weights, scores, log_prob). Weights from the chunked
        kernel are recomputed block by block and carry no gradient.
    """
    call = prepare_call(
        q,
        k,
        v,
        score=score,
        align=align,
        mask=mask,
        bias=bias,
        need_weights=need_weights,
        chunk_size=chunk_size,
        dropout=dropout,
        kernel=kernel,
        block_mask=block_mask,
        score_mod=score_mod,
    )
    return kernels.select(call, kernel).attend(call)


def prepare_call(
    q: Tensor | None,
    k: Tensor,
    v: Tensor | None = None,
    *,
    score: str | Score = "scaled_dot",
    align: str | Alignment = "softmax",
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    chunk_size: int | None = None,
    dropout: float = 0.0,
    kernel: str | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
) -> Call:
    """The validated call that :func:`attention` hands to a kernel, for the same arguments
    (what :func:`attnkit.kernels.explain` reads); raises as :func:`attention` does."""
    score_part = checks.resolve_score(score)
    align_mod = checks.resolve_alignment(align)
    if v is None:
        v = k
    if trust.is_trusted():
        # The per-head call of a layer that validated its inputs, mask and bias at its door and
        # shaped them itself: only what that door cannot know about this part is checked.
        shape = _trusted_shape(q, k, v, score_part)
    else:
        shape = checks.validate(q, k, v, score_part, mask=mask, bias=bias, align=align_mod)
    if not isinstance(need_weights, bool):
        raise TypeError(f"need_weights must be a bool, got {need_weights!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a number in [0, 1), got {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if block_mask is not None:
        check_type(block_mask)
        block_mask.check(shape)
    if score_mod is not None:
        inputs.score_mod(score_mod)
    call = Call(
        q,
        k,
        v,
        score_part,
        align_mod,
        shape,
        mask=mask,
        bias=bias,
        need_weights=need_weights,
        chunk_size=chunk_size,
        dropout=float(dropout),
        block_mask=block_mask,
        score_mod=score_mod,
    )
    call = _exclude_masked(call)
    if kernel is None:
        call = _block_sparse(call)
    return call


def _trusted_shape(q: Tensor | None, k: Tensor, v: Tensor, score: Score) -> torch.Size:
    """The scores' shape (B, …, M, N) of a call made inside :func:`attnkit.trust.trusted`.

    The door (e.g. :meth:`attnkit.MultiHeadAttention.forward`) checked the tensors, the mask and
    the bias and shaped q, k and v itself; what it cannot know is whether this score suits them
    (its head count and, for a multi-dimensional score, d_out) and whether any key is left."""
    check_heads(score, q, k)
    if k.shape[-2] == 0:
        raise ValueError(f"k has no keys (N = 0, shape {tuple(k.shape)}); attention needs N >= 1")
    if score.multi_dimensional and score.d_out != v.shape[-1]:
        raise ValueError(
            f"the multi-dimensional score gives d_out = {score.d_out} scores per key but v has "
            f"d_v = {v.shape[-1]} features (shape {tuple(v.shape)}); they must match (eq. 30)"
        )
    return checks.scores_shape(q, k)


def _block_sparse(call: Call) -> Call:
    """The call with its dense mask as a block mask, when most of the mask's tiles are empty
    (:func:`attnkit.kernels.block_mask.from_dense_auto`) and the chunked kernel evaluates the call
    as it is (no weights asked for: the chunked kernel's weights carry no gradient). The result
    equals the dense masked result; the cost follows the share of tiles holding an allowed pair."""
    if (
        call.mask is None
        or call.block_mask is not None
        or call.chunk_size is not None
        or call.need_weights
        or torch.compiler.is_compiling()
    ):
        return call
    block_mask = from_dense_auto(call.mask, call.shape)
    if block_mask is None or kernels.get("chunked").reasons_not_supported(call):
        return call
    return dataclasses.replace(call, mask=None, block_mask=block_mask)


class Attention(HeadAttention):
    """The general attention module: a score part and an alignment part (Brauwers Fig. 2).

    Args:
        score: a :class:`attnkit.scores.Score` module or the name of a parameter-free one.
        align: an :class:`attnkit.alignments.Alignment` module or the name of a parameter-free
            one.
        multi_dimensional: optional assertion. Dimensionality is a property of the score (an
            additive-family score built with ``d_out=d_v`` is multi-dimensional, eq. 31); pass
            True or False to have a mismatch raise at construction.
        dropout: dropout on the weights in training mode.
        kernel: the kernel of every call that does not ask for the weights (a name from
            :func:`attnkit.kernels.available`; None: chosen per call by priority), for training
            and inference; a kernel that cannot serve such a call raises with its reasons. A
            call that asks for the weights (``need_weights=True``, a capture or hook, a
            report's heatmaps) is evaluated by a kernel that returns them, as without the
            setting. A call's own ``kernel=`` takes precedence and is always forced.

    ``forward(q, k, v=None, *, mask=None, bias=None, need_weights=False, chunk_size=None,
    kernel=None, block_mask=None, score_mod=None)``
    returns an :class:`AttentionOutput`; see :func:`attention`.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    # Every query attends over the keys it is given; MultiHeadAttention also checks the score
    # and the alignment (one that mixes keys or reads query positions may still refuse).
    decodes_with_cache: ClassVar[bool] = True
    # Scores exist as a (…, M, N) matrix: a block mask restricts them tile by tile and a
    # score_mod rewrites them (the layers read these and refuse parts that lack them).
    accepts_block_mask: ClassVar[bool] = True
    accepts_score_mod: ClassVar[bool] = True

    def __init__(
        self,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        *,
        multi_dimensional: bool | None = None,
        dropout: float = 0.0,
        kernel: str | None = None,
    ) -> None:
        super().__init__()
        if kernel is not None:
            kernels.get(kernel)  # an unknown name fails here, listing the kernels
        self.kernel = kernel
        self.score = checks.resolve_score(score)
        self.align = checks.resolve_alignment(align)
        if multi_dimensional is not None and multi_dimensional != self.score.multi_dimensional:
            raise ValueError(
                f"multi_dimensional={multi_dimensional} but the score "
                f"{type(self.score).__name__} is "
                f"{'multi' if self.score.multi_dimensional else 'single'}-dimensional; build an "
                "additive-family score with d_out=d_v for multi-dimensional attention (eq. 31)"
            )
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise TypeError(f"dropout must be a number in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)

    def forward(
        self,
        q: Tensor | None,
        k: Tensor,
        v: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
        chunk_size: int | None = None,
        kernel: str | None = None,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> AttentionOutput:
        need_weights = need_weights or hooks.listening()
        if kernel is None and not need_weights:
            kernel = self.kernel
        out = attention(
            q,
            k,
            v,
            score=self.score,
            align=self.align,
            mask=mask,
            bias=bias,
            need_weights=need_weights,
            chunk_size=chunk_size,
            dropout=self.dropout if self.training else 0.0,
            kernel=kernel,
            block_mask=block_mask,
            score_mod=score_mod,
        )
        hooks.report(self, out.weights)
        return out
