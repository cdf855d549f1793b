"""The general attention model (Brauwers Sec. 2, Fig. 2): score -> align -> weighted average.

:func:`attention` is the functional core; :class:`Attention` the module holding a score and an
alignment part.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from attnkit import checks, hooks, kernels
from attnkit.alignments import Alignment
from attnkit.head import HeadAttention
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kernels.chunked import DENSE_LIMIT
from attnkit.kernels.prepare import check_for_score, prepare_call
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["DENSE_LIMIT", "Attention", "AttentionOutput", "attention"]


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
    kernel=None, block_mask=None, score_mod=None, checked=False, finite=False)``
    returns an :class:`AttentionOutput`; see :func:`attention`. ``checked`` and ``finite`` are
    a caller's facts (:class:`attnkit.HeadAttention`): the inputs were validated at its door
    (only what it cannot know about this score is checked), k and v are finite everywhere
    (masked keys are neither looked at nor cleared).
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
    # forward takes the caller's facts checked= and finite= (attnkit.head.HeadAttention)
    takes_facts: ClassVar[bool] = True

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
        checked: bool = False,
        finite: bool = False,
    ) -> AttentionOutput:
        need_weights = need_weights or hooks.listening()
        if kernel is None and not need_weights:
            kernel = self.kernel
        call = prepare_call(
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
            checked=checked,
            finite=finite,
        )
        out = kernels.select(call, kernel).attend(call)
        hooks.report(self, out.weights)
        return out

    def direct(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        finite: bool = False,
    ) -> AttentionOutput | None:
        """This part's call on inputs a layer's plan has checked (:mod:`attnkit.call_plan`),
        evaluated as :meth:`forward` would evaluate it without building and selecting again
        (``finite``: the caller states that k and v hold no NaN or infinity, so masked keys
        are not cleared):
        by the direct entry (:meth:`attnkit.kernels.Kernel.direct`) of its kernel, or of the
        kernel automatic selection tries first. None when that entry cannot be sure to give
        what :meth:`forward` would (weights listened to, no direct entry, inputs for which
        selection could choose otherwise); the layer then calls :meth:`forward`."""
        if hooks.listening():
            return None
        check_for_score(q, k, v, self.score)  # (what the layer cannot know)
        kernel = kernels.REGISTRY.chosen(self.kernel)
        if kernel is None:
            return None
        dropout = self.dropout if self.training else 0.0
        return kernel.direct(
            q, k, v, self.score, self.align, mask=mask, bias=bias, dropout=dropout,
            keep_masked=finite,
        )  # fmt: skip
