"""What form a score_mod has, read from its traced graph."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

from attnkit.kernels.block_mask import ScoreMod

__all__ = ["is_additive", "is_relative"]

# score_mod -> (additive, relative), read from one trace per function (see _form).
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_additive(score_mod: ScoreMod) -> bool | None:
    """True when ``score_mod(e, …)`` is ``e + f(b, h, q_idx, kv_idx)`` with f independent of e
    (a relative-position bias such as ALiBi), read from its traced graph: then its effect is the
    additive term f = score_mod(0, …) that the fused kernel adds to its scores. None otherwise
    (a score_mod is a pointwise function of its arguments, as in FlexAttention)."""
    return _form(score_mod)[0] or None


def is_relative(score_mod: ScoreMod) -> bool:
    """True when ``score_mod`` is additive (:func:`is_additive`) and its traced graph reads
    ``q_idx`` and ``kv_idx`` only through their difference (``kv_idx − q_idx`` or
    ``q_idx − kv_idx``): then f(b, h, q_idx, kv_idx) = g(b, h, kv_idx − q_idx), as for ALiBi
    (Press et al.) and relative position biases, and one evaluation per offset gives every
    tile (a Toeplitz matrix per head)."""
    return all(_form(score_mod))


def _form(score_mod: ScoreMod) -> tuple[bool, bool]:
    """(additive, relative) of ``score_mod``, traced once per function and remembered."""
    try:
        known = _FORMS.get(score_mod)
    except TypeError:  # not weakly referable or not hashable: read it each time
        known = None
    if known is None:
        graph = _trace(score_mod)
        additive = graph is not None and _reads_as_additive(graph)
        known = (additive, additive and _reads_as_relative(graph))
        with contextlib.suppress(TypeError):  # not weakly referable: not kept
            _FORMS[score_mod] = known
    return known


def _trace(score_mod: ScoreMod) -> torch.fx.Graph | None:
    """The graph of ``score_mod`` traced on small inputs, or None when it cannot be traced
    (data-dependent control flow, an unsupported op, ...): then nothing is proved about it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    e = torch.zeros(2, 2, 3, 5)
    b, h = _indices_like(e)
    q_idx = torch.arange(3).view(1, 1, 3, 1)
    kv_idx = torch.arange(5).view(1, 1, 1, 5)
    try:
        return make_fx(score_mod, tracing_mode="real")(e, b, h, q_idx, kv_idx).graph
    except Exception:
        return None


def _reads_as_additive(graph: torch.fx.Graph) -> bool:
    nodes = list(graph.nodes)
    scores = next((n for n in nodes if n.op == "placeholder"), None)
    output = next((n for n in nodes if n.op == "output"), None)
    if scores is None or output is None:
        return False
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        if len(result) != 1:
            return False
        result = result[0]
    if not isinstance(result, torch.fx.Node) or result.target != torch.ops.aten.add.Tensor:
        return False
    if result.kwargs.get("alpha", 1) != 1 or len(result.args) != 2:
        return False
    x, y = result.args
    other = y if x is scores else x if y is scores else None
    if other is None or other is scores:
        return False
    if not isinstance(other, torch.fx.Node):
        return True  # e + constant
    seen, stack = set(), [other]
    while stack:  # f must not read e
        node = stack.pop()
        if node is scores:
            return False
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return True


def _reads_as_relative(graph: torch.fx.Graph) -> bool:
    places = [n for n in graph.nodes if n.op == "placeholder"]
    if len(places) != 5:
        return False
    q_node, kv_node = places[3], places[4]
    for node in (q_node, kv_node):
        for user in node.users:
            if user.target != torch.ops.aten.sub.Tensor or user.kwargs.get("alpha", 1) != 1:
                return False
            if set(user.args) != {q_node, kv_node} or len(user.args) != 2:
                return False
    return True


def _indices_like(e: Tensor) -> tuple[Tensor, Tensor]:
    return (
        torch.arange(e.shape[0]).view(-1, 1, 1, 1),
        torch.arange(e.shape[1]).view(1, -1, 1, 1),
    )
