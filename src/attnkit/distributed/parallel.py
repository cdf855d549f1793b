"""A model's context-parallel twin: the same parameters, its attention evaluated over a ring.

:func:`context_parallel` copies a model built from :class:`attnkit.MultiHeadAttention` layers
and gives each layer a :class:`attnkit.distributed.RingAttention` with the layer's own score and
alignment and its position scheme applied by global positions. The copy shares every parameter
and buffer with the model (the same tensors, not copies), so an optimiser over
``model.parameters()`` trains both, the model's checkpoint is the copy's, and the model itself
still runs on one process (evaluation, generation) with the weights the ring trained.
"""

from __future__ import annotations

import copy
import itertools

import torch.distributed as dist
from torch import nn

from attnkit.core import Attention
from attnkit.distributed.attention import RingAttention
from attnkit.distributed.layout import check_layout
from attnkit.distributed.positions import RingPositions
from attnkit.multihead import MultiHeadAttention
from attnkit.positions.none import NoPosition

__all__ = ["context_parallel"]


def context_parallel(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    causal: bool = False,
) -> nn.Module:
    """A copy of ``model`` sharing its parameters, each multi-head attention over the ring.

    Args:
        model: a module whose attention layers are :class:`attnkit.MultiHeadAttention` with the
            plain score × alignment part (:class:`attnkit.Attention`, no dropout) or already a
            :class:`RingAttention`.
        group: the ring's process group (None: the default group).
        layout: how the copy's inputs are laid out over the ranks (``"contiguous"`` or
            ``"zigzag"``; cut them with :func:`attnkit.distributed.shard`).
        causal: every layer attends causally by global positions (pass no causal mask to the
            copy: a layer's mask may only mark padded keys under a ring).

    Returns:
        The copy; each rank calls it with its part of the tokens, every rank runs the backward
        pass, and the parameters' gradients are each rank's part (sum them over the group).

    A part that the ring cannot evaluate exactly (another mechanism, a score that mixes keys, an
    alignment without streaming statistics, attention dropout, a position scheme that reads
    contents) is refused by name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    layers = [(n, m) for n, m in twin.named_modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise ValueError(
            f"model {type(model).__name__} has no attnkit.MultiHeadAttention layer to run over a "
            "ring"
        )
    for name, layer in layers:
        part = layer.attention
        if isinstance(part, RingAttention):
            continue
        if type(part) is not Attention:
            raise ValueError(
                f"layer {name!r}: attention part {type(part).__name__} cannot be split over a "
                "ring (only the score × alignment part, attnkit.Attention, can)"
            )
        if part.dropout > 0:
            raise ValueError(
                f"layer {name!r}: attention dropout {part.dropout} is not offered by ring "
                "attention; build the model with dropout=0"
            )
        scheme = None if isinstance(layer.position, NoPosition) else layer.position
        try:
            if scheme is not None:
                RingPositions(scheme)
            ring = RingAttention(part.score, part.align, group=group, causal=causal, layout=layout)
        except ValueError as err:
            raise ValueError(f"layer {name!r}: {err}") from None
        if scheme is not None:
            ring.position = RingPositions(scheme)
        layer.attention = ring
        layer.position = NoPosition()
    return twin
