"""A model's context-parallel twin: the same parameters, its attention evaluated over a ring.

:func:`context_parallel` copies a model built from :class:`attnkit.MultiHeadAttention` layers
and gives each layer a :class:`attnkit.distributed.RingAttention` with the layer's own score and
alignment, its position scheme applied by global positions, and causal where the model attends
causally (a decoder's self-attention); absolute position embeddings add each rank's tokens at
their global positions. The copy shares every parameter and buffer with the model (the same
tensors, not copies), so an optimiser over ``model.parameters()`` trains both, the model's
checkpoint is the copy's, and the model itself still runs on one process (evaluation,
generation) with the weights the ring trained.
"""

from __future__ import annotations

import copy
import itertools

import torch.distributed as dist
from torch import nn

from attnkit.distributed.attention import RingAttention
from attnkit.distributed.forms import Placement, ring_part
from attnkit.distributed.latent import RingLatentAttention
from attnkit.distributed.layout import check_layout
from attnkit.distributed.linear_ring import RingLinearAttention
from attnkit.distributed.positions import RingAbsolute
from attnkit.modern.latent import MultiHeadLatentAttention
from attnkit.multihead import MultiHeadAttention
from attnkit.positions.none import NoPosition

__all__ = ["context_parallel"]


def context_parallel(
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    causal: bool | None = None,
) -> nn.Module:
    """A copy of ``model`` sharing its parameters, each multi-head attention over the ring.

    Args:
        model: a module whose attention layers are :class:`attnkit.MultiHeadAttention` with a
            part that has a form over the ring (the score × alignment part
            :class:`attnkit.Attention` without dropout, a sink part, a part of the gated
            linear family) or already a ring part, and
            :class:`attnkit.modern.MultiHeadLatentAttention` layers: a stack of them,
            :class:`attnkit.models.decoder_lm.DecoderLM`, the encoder–decoder
            :class:`attnkit.Transformer`, a hybrid stack, ...
        group: the ring's process group (None: the default group).
        layout: how the copy's inputs are laid out over the ranks (``"contiguous"`` or
            ``"zigzag"``; cut them with :func:`attnkit.distributed.shard`).
        causal: which layers attend causally, by global positions. None: those the model
            declares causal (a layer class naming its causal attention submodules in
            ``causal_attention``, as :class:`attnkit.transformer.TransformerDecoderLayer` does
            for its self-attention; the layer's causal mask then reaches a causal ring part);
            the others not. True: every layer, for a model that declares none (pass no causal
            mask to the copy then). False: none; refused for a model that declares causal
            layers.

    Returns:
        The copy; each rank calls it with its part of the tokens, every rank runs the backward
        pass, and the parameters' gradients are each rank's part (sum them over the group).
        Absolute position embeddings (modules declaring ``absolute = True``, such as
        DecoderLM's learned table) add each rank's tokens at their global positions
        (:class:`attnkit.distributed.positions.RingAbsolute`); per-head position schemes move
        into the ring parts.

    Each layer's part takes the first form over the ring that claims it
    (:mod:`attnkit.distributed.forms`): the score × alignment part
    (:class:`RingAttention`), the sink part (the same ring with the sink softmax in streaming
    form) or a part that declares a recurrent state, the gated linear family
    (:class:`attnkit.distributed.RingLinearAttention`, the states composed across the ranks).
    Multi-head latent attention layers (:class:`attnkit.modern.MultiHeadLatentAttention`,
    causal as declared in ``causal_attention`` or by ``causal``) become
    :class:`attnkit.distributed.RingLatentAttention`, passing their latents around the ring.
    A part that no form claims (another mechanism) is refused naming the part and every
    form's reason; one that its form cannot run exactly (a score that mixes keys, an
    alignment without streaming statistics, attention dropout, a position scheme that reads
    contents), or a ``causal`` that contradicts the model, is refused by name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_layout(layout)
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool or None, got {causal!r}")
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    layers = [(n, m) for n, m in twin.named_modules() if isinstance(m, MultiHeadAttention)]
    placed = {
        id(m) for r in twin.modules() if isinstance(r, RingLatentAttention) for m in r.modules()
    }
    latent = [
        (n, m)
        for n, m in twin.named_modules()
        if isinstance(m, MultiHeadLatentAttention) and id(m) not in placed
    ]
    if not layers and not latent:
        raise ValueError(
            f"model {type(model).__name__} has no attnkit.MultiHeadAttention layer (nor an "
            "attnkit.modern.MultiHeadLatentAttention) to run over a ring"
        )
    declared = _declared_causal(twin)
    for name, layer in layers:
        part = layer.attention
        if isinstance(part, (RingAttention, RingLinearAttention)):
            continue
        layer_causal = _layer_causal(name, id(layer) in declared, causal, bool(declared))
        scheme = None if isinstance(layer.position, NoPosition) else layer.position
        try:
            ring = ring_part(part, Placement(group, layout, layer_causal, scheme))
        except ValueError as err:
            raise ValueError(f"layer {name!r}: {err}") from None
        if isinstance(ring, RingAttention):
            ring.causal_by_mask = causal is None and layer_causal  # the layer's mask says so
        layer.attention = ring
        layer.position = NoPosition()
    for name, module in latent:
        layer_causal = _layer_causal(name, id(module) in declared, causal, bool(declared))
        ring = RingLatentAttention(module, group=group, layout=layout, causal=layer_causal)
        ring.causal_by_mask = causal is None and layer_causal
        if not name:  # the model is the layer
            return ring
        _replace(twin, name, ring)
    for parent in list(twin.modules()):
        if isinstance(parent, RingAbsolute):  # a twin's twin: placed already
            continue
        for child_name, child in list(parent.named_children()):
            if getattr(type(child), "absolute", False):
                setattr(parent, child_name, RingAbsolute(child, group=group, layout=layout))
    return twin


def _declared_causal(model: nn.Module) -> set[int]:
    """The ids of the MultiHeadAttention layers inside the submodules that the model's layer
    classes declare causal (``causal_attention``: attribute names)."""
    out: set[int] = set()
    for module in model.modules():
        for attribute in getattr(type(module), "causal_attention", ()):
            sub = getattr(module, attribute, None)
            if isinstance(sub, nn.Module):
                out |= {
                    id(m)
                    for m in sub.modules()
                    if isinstance(m, (MultiHeadAttention, MultiHeadLatentAttention))
                }
    return out


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` inside ``model``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _layer_causal(name: str, declared: bool, causal: bool | None, any_declared: bool) -> bool:
    """Whether layer ``name`` attends causally in the twin; ValueError when ``causal``
    contradicts what the model declares."""
    if causal is None:
        return declared
    if causal and any_declared and not declared:
        raise ValueError(
            f"causal=True makes every layer causal, but the model declares which of its layers "
            f"attend causally and layer {name!r} does not (an encoder's self-attention or a "
            "cross-attention); leave causal=None to follow the model"
        )
    if not causal and declared:
        raise ValueError(
            f"causal=False makes no layer causal, but layer {name!r} attends causally in the "
            "model (a decoder's self-attention, given a causal mask); leave causal=None to "
            "follow the model"
        )
    return causal
