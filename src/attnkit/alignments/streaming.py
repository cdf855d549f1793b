"""The streaming protocol: what an alignment states so that kernels can evaluate it block by block.

A chunked kernel (:mod:`attnkit.kernels.chunked`) never holds a whole score row. It hands the
alignment *tiles*: prepared scores of a block of query rows × a block of keys, shaped
(…, M_b, N_b) with the key axis last, in float32 (float64 for float64 inputs), with −inf where a
key is masked. An alignment that can work from tiles implements:

- :meth:`Streaming.stream_prepare` — scores to the units the alignment works in (e.g. e/τ);
  differentiable, so a learned parameter used here gets its gradient from the kernel.
- :meth:`Streaming.stream_statistic` — a per-row statistic (…, M_b, C) from one or more passes
  over the tiles of those rows (e.g. the row maximum and log-normaliser of softmax, the threshold
  τ of α-entmax).
- :meth:`Streaming.stream_weights` — the weight of each score of a tile given its row's statistic.
- :meth:`Streaming.stream_slope` — what the backward pass needs: with weights p = f(e), the
  vector–Jacobian product is ∂L/∂e = s ⊙ (∂L/∂p − c), where c = Σ_l r_l ∂L/∂p_l / Σ_l r_l per row
  (``r`` is None for alignments whose weights are independent, then c = 0).
- optionally :meth:`Streaming.stream_accumulate` / :meth:`Streaming.stream_finish` for a
  one-pass forward with running rescaling (online softmax).

Rows with no allowed key may get any finite weights from the alignment: the kernel sets their
weights and context to 0 (DESIGN 2). Everything the kernel needs is read from this protocol; it
never inspects an alignment's class or private attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

from torch import Tensor

__all__ = ["Streaming", "Tiles"]

# Calling it starts a fresh pass over the key blocks of the current query rows.
Tiles = Callable[[], Iterator[Tensor]]


class Streaming:
    """Mixin for alignments that can be evaluated block by block over keys.

    Class attributes (capabilities as data):

    - ``stream_online``: implements :meth:`stream_accumulate` / :meth:`stream_finish`, so the
      forward pass needs one sweep over the keys instead of statistic + weighted sum.
    - ``stream_weights_are_correction``: ``r`` = the weights and rows sum to 1, so the backward
      correction c equals ∂L/∂context · context and needs no extra sweep (softmax).
    """

    stream_online: ClassVar[bool] = False
    stream_weights_are_correction: ClassVar[bool] = False

    def stream_reasons(self) -> list[str]:
        """Why this instance cannot be streamed (empty when it can), e.g. a learned α."""
        return []

    def stream_prepare(self, e: Tensor) -> Tensor:
        """Scores in the alignment's working units; identity by default."""
        return e

    def stream_statistic(self, tiles: Tiles) -> Tensor | None:
        """Per-row statistic (…, M_b, C) from passes over ``tiles()``; None if weights are
        independent of the other keys."""
        raise NotImplementedError

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        """Weights of the prepared scores ``e`` (…, M_b, N_b); 0 where ``e`` is −inf."""
        raise NotImplementedError

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(s, r) for the backward pass: ∂L/∂e = s ⊙ (∂L/∂p − Σ r ∂L/∂p / Σ r); r None = no
        coupling between keys."""
        raise NotImplementedError

    def stream_accumulate(
        self, e: Tensor, state: tuple[Tensor, ...] | None
    ) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...]]:
        """One tile of a one-pass forward: (unnormalised weights, factor by which to rescale what
        was accumulated so far (…, M_b, 1) or None on the first tile, new state)."""
        raise NotImplementedError

    def stream_finish(self, state: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """After the last tile: (normaliser (…, M_b, 1) to divide the accumulated sum by, the
        per-row statistic that :meth:`stream_weights` takes)."""
        raise NotImplementedError
