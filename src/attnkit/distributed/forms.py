"""Which form a per-head attention part takes over the ring, and the ring part that runs it.

:func:`attnkit.distributed.context_parallel` asks every form in :data:`FORMS` in turn; the first
that claims a part builds its ring twin (sharing the part's parameters), and a part that no
form claims is refused naming the part and every form's reason (as a kernel dispatcher lists
every candidate's reasons):

- **score × alignment** — the plain part :class:`attnkit.Attention`: blocks of keys travel and
  merge by the alignment's streaming statistics (:class:`attnkit.distributed.RingAttention`);
- **sinks** — :class:`attnkit.modern.SinkAttention`, a score × the sink softmax: the same ring
  with the sink softmax in its streaming form (:class:`StreamingSinkSoftmax`), the sink added
  once per row;
- **recurrent state** — a part that declares a state it continues from (``takes_cache`` and
  ``causal``: the gated linear family): the states are composed across the ranks
  (:class:`attnkit.distributed.RingLinearAttention`).

A form that claims a part but cannot run this instance of it (an alignment without streaming
statistics, attention dropout, a position scheme that adds a bias to a linear part) raises its
own reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch.distributed as dist
from torch import nn

from attnkit.core import Attention
from attnkit.distributed.attention import RingAttention
from attnkit.distributed.linear_ring import RingLinearAttention, reasons_not_recurrent
from attnkit.distributed.positions import RingPositions
from attnkit.distributed.sinks import StreamingSinkSoftmax
from attnkit.modern.sinks import SinkAttention
from attnkit.positions import PositionScheme

__all__ = ["FORMS", "Placement", "ring_part"]


class Placement(NamedTuple):
    """Where the twin runs: the ring's group and layout, whether the layer attends causally
    (by global positions), and the layer's position scheme (None for none)."""

    group: dist.ProcessGroup | None
    layout: str
    causal: bool
    position: PositionScheme | None


def _score_alignment(part: nn.Module, where: Placement) -> nn.Module | str:
    if type(part) is not Attention:
        return "it is not the score × alignment part (attnkit.Attention)"
    if part.dropout > 0:
        raise ValueError(
            f"attention dropout {part.dropout} is not offered by ring attention; build the "
            "model with dropout=0"
        )
    return _softmax_ring(part.score, part.align, where)


def _sinks(part: nn.Module, where: Placement) -> nn.Module | str:
    if not isinstance(part, SinkAttention):
        return "it is not a sink part (attnkit.modern.SinkAttention)"
    inner = part.attention
    return _softmax_ring(inner.score, StreamingSinkSoftmax.of(inner.align), where)


def _recurrent(part: nn.Module, where: Placement) -> nn.Module | str:
    reasons = reasons_not_recurrent(part)
    if reasons:
        return "; ".join(reasons)
    return RingLinearAttention(
        part, group=where.group, layout=where.layout, position=where.position
    )


def _softmax_ring(score, align, where: Placement) -> RingAttention:
    if where.position is not None:
        RingPositions(where.position)  # refuses a scheme the ring cannot place, by name
    ring = RingAttention(score, align, group=where.group, causal=where.causal, layout=where.layout)
    if where.position is not None:
        ring.position = RingPositions(where.position)
    return ring


# Each form returns the ring twin of a part it claims, or why it does not claim the part.
FORMS: tuple[tuple[str, Callable[[nn.Module, Placement], nn.Module | str]], ...] = (
    ("score × alignment", _score_alignment),
    ("sinks", _sinks),
    ("recurrent state", _recurrent),
)


def ring_part(part: nn.Module, where: Placement) -> nn.Module:
    """The ring twin of the per-head part ``part`` (sharing its parameters), placed as
    ``where`` says; ValueError naming the part and every form's reason when no form claims
    it, or the claiming form's reason when it cannot run this instance."""
    reasons = []
    for name, form in FORMS:
        twin = form(part, where)
        if not isinstance(twin, str):
            return twin
        reasons.append(f"{name}: {twin}")
    raise ValueError(
        f"attention part {type(part).__name__} cannot run over a ring (" + "; ".join(reasons) + ")"
    )
