"""Attention sinks over the ring: the sink softmax of :mod:`attnkit.modern.sinks` in the streaming
protocol (:mod:`attnkit.alignments.streaming`), so that ring attention — and any kernel that
reads the protocol — merges key blocks for it as for softmax.

With head h's sink logit s_h, a row's weights are a_j = exp(e_j) / (exp(s_h) + Σ_l exp(e_l)).
Subtracting s_h from every score leaves them unchanged and moves the sink to logit 0:

    a_j = exp(e_j − s_h) / (1 + Σ_l exp(e_l − s_h)),

so the blocks are merged by online softmax over the shifted scores (running maximum m and sum
Σ exp(e − s − m)), and the sink enters **once per row**, when its owner finishes the row: the
normaliser is Σ + exp(−m), never a term per key block. The shift is the protocol's
``stream_prepare``, differentiable, so the sink logit's gradient is the kernel's sum of
∂L/∂e over the row's keys (−p_sink · Σ_j a_j ∂L/∂a_j, the sink column's own term, whose value
is 0); and as the sink's value is 0 the backward correction Σ_j a_j ∂L/∂a_j is still
∂L/∂context · context (``stream_weights_are_correction``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments import Alignment, AlignOutput, Softmax
from attnkit.alignments.streaming import Streaming, Tiles
from attnkit.modern.sinks import SinkSoftmax, sink_softmax

__all__ = ["StreamingSinkSoftmax"]


class StreamingSinkSoftmax(Streaming, Alignment):
    """Softmax with a learned sink logit per head (GPT-OSS's), in the streaming protocol.

    Args:
        sinks: the sink logits s_h (H,), a parameter shared with the part it comes from (its
            gradient reaches that part); :meth:`of` takes it from a
            :class:`attnkit.modern.SinkSoftmax`.

    Scores are (…, H, M, N) with the heads third from the end, as the sink softmax takes them;
    weights sum to σ(logsumexp e − s_h) < 1 per row. A row whose scores all lie more than the
    dtype's exponent range below its sink (≈ 709 in float64, 88 in float32) gets weights 0
    instead of weights below that range.
    """

    stream_online: ClassVar[bool] = True
    stream_weights_are_correction: ClassVar[bool] = True
    label = tx.AlignmentKind.GLOBAL
    normalized = False  # the rest of each row's mass is on the sink

    def __init__(self, sinks: nn.Parameter) -> None:
        super().__init__()
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or not sinks.is_floating_point():
            what = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise TypeError(f"sinks must be a floating tensor of shape (H,), got {what}")
        self.sinks = sinks if isinstance(sinks, nn.Parameter) else nn.Parameter(sinks)
        self._online = Softmax()

    @classmethod
    def of(cls, align: SinkSoftmax) -> StreamingSinkSoftmax:
        """The streaming form of ``align``, sharing its sink logits."""
        if not isinstance(align, SinkSoftmax):
            raise TypeError(
                f"align must be an attnkit.modern.SinkSoftmax, got {type(align).__name__}"
            )
        return cls(align.sinks)

    @property
    def num_heads(self) -> int:
        return self.sinks.shape[0]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"

    def _heads(self, scores: Tensor) -> Tensor:
        """s_h shaped (H, 1, 1) against scores (…, H, M, N); ValueError for other heads."""
        if scores.dim() < 3 or scores.shape[-3] != self.num_heads:
            raise ValueError(
                f"StreamingSinkSoftmax has {self.num_heads} sink logits: scores must be "
                f"(…, H, M, N) with H = {self.num_heads}, got shape {tuple(scores.shape)}"
            )
        return self.sinks.to(scores.dtype)[:, None, None]

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        return AlignOutput(sink_softmax(scores, self._heads(scores), mask))

    # ---- streaming protocol -----------------------------------------------------------------

    def stream_prepare(self, e: Tensor) -> Tensor:
        """e − s_h: the sink moves to logit 0."""
        return e - self._heads(e)

    def stream_accumulate(self, e, state):
        return self._online.stream_accumulate(e, state)

    def stream_finish(self, state):
        top, total = state
        empty = total == 0
        undefined = torch.isnan(top) | (top == float("inf"))
        top = torch.where(empty, torch.zeros((), dtype=top.dtype), top)
        # the sink, once per row: exp(0 − m) in the units of the accumulated sum
        norm = torch.where(empty, torch.ones((), dtype=total.dtype), total + torch.exp(-top))
        norm = torch.where(undefined, torch.full((), float("nan"), dtype=norm.dtype), norm)
        return norm, torch.cat([top, torch.log(norm)], dim=-1)

    def stream_statistic(self, tiles: Tiles) -> Tensor:
        state = None
        for e in tiles():
            _, _, state = self.stream_accumulate(e, state)
        if state is None:
            raise ValueError("StreamingSinkSoftmax: no score tile to take the statistic of")
        return self.stream_finish(state)[1]

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        if stat is None:
            raise ValueError("StreamingSinkSoftmax: the weights need the row statistic")
        return torch.exp((e - stat[..., :1]) - stat[..., 1:])

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return p, p
