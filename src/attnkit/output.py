"""The value every attention call returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

__all__ = ["AttentionOutput", "HeadOutput"]


class AttentionOutput(NamedTuple):
    """Result of an attention call; fields that were not requested are None.

    Attributes:
        context: (B, …, M, d_v) — c = Σ_l a_l v_l (Brauwers eq. 4), one row per query.
        weights: (B, …, M, N), or (B, …, M, N, d_v) for multi-dimensional attention; only with
            ``need_weights=True``.
        scores: the scores e before alignment, same shape as ``weights``; only with
            ``need_weights=True``.
        log_prob: (B, …, M) [(B, …, M, d_v) multi-dimensional], log-probability of the sampled
            choice for stochastic alignments (hard, reinforced); None otherwise.
        extra: the weights a part computes besides (or instead of) one (…, M, N) matrix, by
            name, e.g. the Nyström factors ``to_landmarks`` F (…, M, m) and ``from_landmarks``
            B (…, m, N) whose product through a pseudo-inverse is ``weights``, FMMformer's
            ``near`` and ``far`` fields, the differential attention's two ``maps``; None when
            the part names none. :meth:`named_weights` reports them in place of ``weights``.
    """

    context: Tensor
    weights: Tensor | None = None
    scores: Tensor | None = None
    log_prob: Tensor | None = None
    extra: dict[str, Tensor] | None = None

    @property
    def representation(self) -> Tensor:
        """The context, under the name the mechanism family reads
        (:class:`attnkit.mechanisms.MechanismOutput`)."""
        return self.context

    def named_weights(self) -> dict[str, Tensor]:
        """The weights by name: ``extra`` when the part names its weights, else
        ``{"weights": weights}`` (empty when none were requested)."""
        if self.extra is not None:
            return dict(self.extra)
        return {} if self.weights is None else {"weights": self.weights}

    def map(self, fn: Callable[[Tensor], Tensor]) -> AttentionOutput:
        """This output with ``fn`` applied to every tensor it holds (those of ``extra``
        included), e.g. ``out.map(lambda t: t.squeeze(0))``; None stays None."""
        extra = None if self.extra is None else {k: fn(t) for k, t in self.extra.items()}
        fields = (None if t is None else fn(t) for t in self[:4])
        return AttentionOutput(*fields, extra=extra)


# The per-head parts' former output type, now AttentionOutput itself.
HeadOutput = AttentionOutput
