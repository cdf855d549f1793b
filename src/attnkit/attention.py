"""The general attention model (Brauwers Sec. 2, Fig. 2): score -> align -> weighted average.

:func:`attention` is the functional core; :class:`Attention` the module holding a score and an
alignment part.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnkit import checks
from attnkit.alignments import Alignment
from attnkit.evaluation.capture import weights_forced
from attnkit.kernels import chunked, dense, sdpa
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["DENSE_LIMIT", "Attention", "AttentionOutput", "attention"]

# Above this many elements in the dense score tensor(s) (B·…·M·N·d_w), attention() evaluates
# in chunks when it can (2^24 float32 elements = 64 MiB).
DENSE_LIMIT = 1 << 24


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
            allowed gets weights 0 and context 0.
        bias: float tensor added to the scores, broadcastable to (B, …, M, N).
        need_weights: also return the weights and the scores.
        chunk_size: evaluate in blocks of this many keys (memory-efficient, exact; see
            :mod:`attnkit.kernels.chunked`). None chooses: SDPA for a dot-product score with
            softmax, chunked when the dense score tensor would exceed :data:`DENSE_LIMIT`
            elements and the alignment streams (softmax, sigmoid, sparsemax, α-entmax with
            1 < α ≤ 2), dense otherwise.
        dropout: dropout probability on the weights (apply only in training).

    Returns:
        :class:`AttentionOutput` (context, weights, scores, log_prob).

    When the score is in dot-product form, the alignment is plain softmax and no weights are
    requested, this calls ``torch.nn.functional.scaled_dot_product_attention``. Weights from
    the chunked path are recomputed block by block and carry no gradient.
    """
    score_mod = checks.resolve_score(score)
    align_mod = checks.resolve_alignment(align)
    if v is None:
        v = k
    shape = checks.validate(q, k, v, score_mod, mask=mask, bias=bias)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if chunk_size is not None:
        if dropout > 0.0:
            raise ValueError("chunk_size: chunked evaluation does not apply dropout; pass 0")
        return chunked.attend(
            q,
            k,
            v,
            score_mod,
            align_mod,
            mask=mask,
            bias=bias,
            need_weights=need_weights,
            chunk_size=chunk_size,
        )
    if sdpa.can_dispatch(score_mod, align_mod, need_weights=need_weights):
        return sdpa.attend(q, k, v, score_mod, align_mod, mask=mask, bias=bias, dropout=dropout)
    dense_elements = shape.numel() * chunked.tile_width(score_mod)
    if dropout == 0.0 and chunked.supports(align_mod) and dense_elements > DENSE_LIMIT:
        return chunked.attend(
            q, k, v, score_mod, align_mod, mask=mask, bias=bias, need_weights=need_weights
        )
    return dense.attend(
        q,
        k,
        v,
        score_mod,
        align_mod,
        mask=mask,
        bias=bias,
        need_weights=need_weights,
        dropout=dropout,
    )


class Attention(nn.Module):
    """The general attention module: a score part and an alignment part (Brauwers Fig. 2).

    Args:
        score: a :class:`attnkit.scores.Score` module or the name of a parameter-free one.
        align: an :class:`attnkit.alignments.Alignment` module or the name of a parameter-free
            one.
        multi_dimensional: optional assertion. Dimensionality is a property of the score (an
            additive-family score built with ``d_out=d_v`` is multi-dimensional, eq. 31); pass
            True or False to have a mismatch raise at construction.
        dropout: dropout on the weights in training mode.

    ``forward(q, k, v=None, *, mask=None, bias=None, need_weights=False, chunk_size=None)``
    returns an :class:`AttentionOutput`; see :func:`attention`.
    """

    def __init__(
        self,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        *,
        multi_dimensional: bool | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.score = checks.resolve_score(score)
        self.align = checks.resolve_alignment(align)
        if multi_dimensional is not None and multi_dimensional != self.score.multi_dimensional:
            raise ValueError(
                f"multi_dimensional={multi_dimensional} but the score "
                f"{type(self.score).__name__} is "
                f"{'multi' if self.score.multi_dimensional else 'single'}-dimensional; build an "
                "additive-family score with d_out=d_v for multi-dimensional attention (eq. 31)"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout = dropout

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
    ) -> AttentionOutput:
        return attention(
            q,
            k,
            v,
            score=self.score,
            align=self.align,
            mask=mask,
            bias=bias,
            need_weights=need_weights or weights_forced(),
            chunk_size=chunk_size,
            dropout=self.dropout if self.training else 0.0,
        )
