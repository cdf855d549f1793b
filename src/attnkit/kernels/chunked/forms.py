"""What form a score_mod has (:class:`attnkit.score_mods.Form`): declared by the typed
constructors of :mod:`attnkit.score_mods`, or, for a plain function, read from its graph traced
once on small inputs.

The fused block-sparse path reads two facts. *Additive*: ``score_mod(e, …)`` is ``e + f(b, h,
q_idx, kv_idx)`` with f independent of e, so that f = score_mod(0, …) enters the fused kernel as
its additive mask. *Relative*: f reads q_idx and kv_idx only through their difference (ALiBi,
relative position biases), so that one evaluation per distance gives every tile.

The traced graph proves the form; nothing is guessed from values. A graph is additive when its
output is e plus and minus terms that do not read e (``e + f``, ``f + e``, ``e - f``,
``(e + f) - g``, ...), and relative when every use of q_idx and of kv_idx is their difference
(``q_idx - kv_idx`` or ``kv_idx - q_idx``, whatever follows: ``.abs()``, a product with a
slope, a table lookup). Any other graph, or a function that cannot be traced (data-dependent
control flow), is neither: it takes the tiled path, which evaluates any score_mod exactly.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

from attnkit.kernels.block_mask import ScoreMod
from attnkit.score_mods import OTHER, Declared, Form

__all__ = ["form_of", "is_additive", "is_relative"]

# plain score_mod -> its form, read from one trace per function.
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_ADD = {torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar}
_SUB = {torch.ops.aten.sub.Tensor, torch.ops.aten.sub.Scalar}


def is_additive(score_mod: ScoreMod) -> bool | None:
    """True when ``score_mod(e, …)`` is ``e + f(b, h, q_idx, kv_idx)`` with f independent of e:
    its effect is then the additive term f = score_mod(0, …). None otherwise."""
    return form_of(score_mod).additive or None


def is_relative(score_mod: ScoreMod) -> bool:
    """True when ``score_mod`` is additive (:func:`is_additive`) with f(b, h, q_idx, kv_idx) =
    g(b, h, q_idx − kv_idx), as for ALiBi (Press et al.) and relative position biases: one
    evaluation per distance gives every tile (a Toeplitz matrix per head)."""
    return form_of(score_mod).relative


def form_of(score_mod: ScoreMod) -> Form:
    """The declared form of a :class:`attnkit.score_mods.Declared` score_mod; for any other
    (or a composition holding a plain function), the form read from its traced graph, traced
    once per function and remembered."""
    if isinstance(score_mod, Declared):
        declared = score_mod.form()
        if declared is not None:
            return declared
    try:
        known = _FORMS.get(score_mod)
    except TypeError:  # not weakly referable or not hashable: read it each time
        known = None
    if known is None:
        known = _read(score_mod)
        with contextlib.suppress(TypeError):  # not weakly referable: not kept
            _FORMS[score_mod] = known
    return known


def _read(score_mod: ScoreMod) -> Form:
    graph = _trace(score_mod)
    if graph is None or not _reads_as_additive(graph):
        return OTHER
    return Form(additive=True, relative=_reads_as_relative(graph))


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
    reads_e = _readers(scores, nodes)
    return isinstance(result, torch.fx.Node) and _e_plus_free(result, scores, reads_e)


def _readers(scores: torch.fx.Node, nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes whose value depends on the scores (in graph order: inputs come first)."""
    out = {scores}
    for node in nodes:
        if any(x in out for x in node.all_input_nodes):
            out.add(node)
    return out


def _e_plus_free(node: torch.fx.Node, scores, reads_e: set) -> bool:
    """Whether ``node`` is e + (terms that do not read e): e itself, a sum with e-free terms
    (any alpha on the e-free one), or a difference e-side minus e-free side."""
    if node is scores:
        return True

    def free(x) -> bool:
        return not isinstance(x, torch.fx.Node) or x not in reads_e

    if node.op != "call_function" or len(node.args) != 2:
        return False
    x, y = node.args
    alpha = node.kwargs.get("alpha", 1)
    if node.target in _ADD:
        if free(y) and isinstance(x, torch.fx.Node):
            return _e_plus_free(x, scores, reads_e)
        if free(x) and alpha == 1 and isinstance(y, torch.fx.Node):
            return _e_plus_free(y, scores, reads_e)
        return False
    if node.target in _SUB:
        return free(y) and isinstance(x, torch.fx.Node) and _e_plus_free(x, scores, reads_e)
    return False


def _reads_as_relative(graph: torch.fx.Graph) -> bool:
    places = [n for n in graph.nodes if n.op == "placeholder"]
    if len(places) != 5:
        return False
    q_node, kv_node = places[3], places[4]
    for node in (q_node, kv_node):
        for user in node.users:
            if user.target not in _SUB or user.kwargs.get("alpha", 1) != 1:
                return False
            if len(user.args) != 2 or set(user.args) != {q_node, kv_node}:
                return False
    return True


def _indices_like(e: Tensor) -> tuple[Tensor, Tensor]:
    return (
        torch.arange(e.shape[0]).view(-1, 1, 1, 1),
        torch.arange(e.shape[1]).view(1, -1, 1, 1),
    )
