"""Attention weights with their autograd graph, for losses on them.

:func:`attnkit.evaluation.capture` records what every part reports to :mod:`attnkit.hooks`,
detached: right for evaluation, useless for a loss. Training on attention — supervising a head
(LISA), distilling a teacher's weights, aligning two models' attention — needs the weights a
part computed inside the forward pass, still connected to the parameters. :func:`capture_weights`
gives them: it asks every multi-head or single-head attention module inside a model for its
weights on each call (its ``need_weights`` argument, set by a forward pre-hook) and keeps the
tensors it returns. The model's code is unchanged and its output is the same.

:func:`stack_head_weights` runs a Transformer stack (``attnkit.transformer``) and returns the
weights of one head of one layer, differentiably.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from attnkit import arguments
from attnkit.core import Attention
from attnkit.multihead import MultiHeadAttention

__all__ = ["attention_modules", "capture_weights", "stack_head_weights"]


@functools.cache
def _takes_need_weights(cls: type[nn.Module]) -> bool:
    if issubclass(cls, (MultiHeadAttention, Attention)):
        return True
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    need = params.get("need_weights")
    return need is not None and need.kind is inspect.Parameter.KEYWORD_ONLY


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` whose weights :func:`capture_weights` records, by name: every
    :class:`attnkit.MultiHeadAttention`, every :class:`attnkit.Attention`, and every module
    whose ``forward`` takes a keyword-only ``need_weights`` — except those inside another one
    (a multi-head module's per-head part reports through the multi-head module)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()

    def walk(module: nn.Module, name: str) -> None:
        if id(module) in seen:  # a shared module is recorded under its first name
            return
        seen.add(id(module))
        if _takes_need_weights(type(module)):
            found[name] = module
            return
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name)

    walk(model, "")
    return found


@contextmanager
def capture_weights(model: nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """``with capture_weights(model) as records: y = model(x)`` fills ``records[name]`` with
    the weights each attention module of ``model`` (see :func:`attention_modules`) returned,
    one entry per call, **with their graph**: a loss on them trains the model.

    Multi-head modules give (B, …, H, M, N). A module called on unbatched inputs, which calls
    itself on a batch of one, is recorded once (the outer call). As under
    :func:`attnkit.hooks.listen`, a call that would otherwise run on SDPA runs on a kernel that
    returns weights: the same attention, rounded differently (≈1e-7 in float32).
    """
    modules = attention_modules(model)
    records: dict[str, list[Tensor]] = {}
    depth: dict[int, int] = {}
    handles = []

    def before(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        depth[id(module)] = depth.get(id(module), 0) + 1
        return args, {**kwargs, "need_weights": True}

    def after(name: str):
        def keep(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
            depth[id(module)] -= 1
            weights = getattr(out, "weights", None)
            if depth[id(module)] == 0 and weights is not None:
                records.setdefault(name, []).append(weights)

        return keep

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(
                module.register_forward_hook(after(name), with_kwargs=True, always_call=True)
            )
        yield records
    finally:
        for handle in handles:
            handle.remove()


def stack_head_weights(
    stack: nn.Module,
    x: Tensor,
    *,
    layer: int,
    head: int | None = None,
    attention: str = "self_attention",
    **forward: Any,
) -> tuple[Tensor, Tensor]:
    """Run a Transformer stack and return ``(output, weights)``, the weights of head ``head``
    of layer ``layer`` (B, M, N) — or of every head (B, H, M, N) with ``head=None`` — with
    their graph.

    Args:
        stack: a module with a ``layers`` list (:class:`attnkit.transformer.TransformerEncoder`,
            :class:`attnkit.transformer.TransformerDecoder`, or any stack built the same way).
        x: the stack's input; ``forward`` holds its other arguments (``mask=…``, ``memory=…``).
        layer: index into ``stack.layers`` (negative counts from the end).
        head: the head; None for all of them.
        attention: which attention of the layer: ``"self_attention"`` or, in a decoder layer,
            ``"cross_attention"``.
    """
    layers = getattr(stack, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"stack must hold its layers in a ModuleList `layers` (a TransformerEncoder or "
            f"TransformerDecoder), got {type(stack).__name__}"
        )
    if (
        isinstance(layer, bool)
        or not isinstance(layer, int)
        or not -len(layers) <= layer < len(layers)
    ):
        raise ValueError(f"layer must be an int in [-{len(layers)}, {len(layers)}), got {layer!r}")
    part = getattr(layers[layer], attention, None)
    if not isinstance(part, nn.Module):
        raise ValueError(
            f"attention must name an attention module of layer {layer} "
            f"('self_attention' or 'cross_attention'), got {attention!r}"
        )
    modules = attention_modules(part)
    if len(modules) != 1:
        raise ValueError(
            f"layer {layer}'s {attention} holds {len(modules)} attention modules; expected one"
        )
    (module,) = modules.values()
    with capture_weights(module) as records:
        out = stack(x, **forward)
    calls = next(iter(records.values()), [])
    if len(calls) != 1:
        raise ValueError(
            f"layer {layer}'s {attention} was called {len(calls)} times in one forward pass; "
            "expected once"
        )
    weights = calls[0]
    if head is None:
        return out, weights
    heads = weights.shape[-3]
    arguments.nonnegative_int(head, "head")
    if head >= heads:
        raise ValueError(f"head must be < {heads} (the layer's number of heads), got {head}")
    return out, weights[..., head, :, :]
