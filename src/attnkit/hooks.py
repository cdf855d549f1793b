"""Hooks to read and rewrite attention: the parts' weight reports and the layers' named points.

Reports, as Flax's ``sow``: a part that computes attention weights calls :func:`report` with
them; nothing is stored unless a :func:`listen` block is active, and then every part asks its
kernel for the weights (:func:`listening` is True), so parts whose caller did not request
weights still have them to report. Evaluation code (``attnkit.evaluation.capture``) builds on
this; the core imports nothing from evaluation.

Inside a :func:`listen` block a dot-product softmax call that would otherwise run on SDPA runs on
a kernel that returns weights (dense or chunked): the same attention, rounded differently
(≈1e-7 in float32).

Named points (:mod:`attnkit.hook_points`). Attention layers (:class:`attnkit.MultiHeadAttention`
and the attention modules of a ``transformers`` model after ``swap_attention``) pass their
activations q, k, v, scores, weights, context and output through named points, named by the
module's path in ``model.named_modules()`` and the point:
``"layers.0.self_attention.module.weights"``. :func:`record` keeps them in an
:class:`ActivationCache` (as TransformerLens' ``run_with_cache`` with a names filter);
:func:`patch` replaces them (activation patching), and :func:`ablate_heads` and
:func:`knock_out` are patches of the context and the scores::

    with ak.hooks.record(model, names=lambda n: n.endswith("weights")) as cache:
        model(x)
    cache["layers.0.self_attention.module.weights"]  # (B, H, M, N)
    with ak.hooks.patch(model, {"layers.1.self_attention.module.context": fn}):
        model(x)  # head contexts replaced by fn(context)
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit import hook_points
from attnkit.hook_points import POINTS

__all__ = [
    "ActivationCache",
    "Report",
    "ablate_heads",
    "knock_out",
    "listen",
    "listening",
    "patch",
    "record",
    "replace_heads",
    "report",
]


class Report(NamedTuple):
    """One reported weight tensor: the reporting module, what it calls the weights, the weights
    (detached)."""

    module: nn.Module
    name: str
    weights: Tensor


_SINK: ContextVar[Callable[[Report], None] | None] = ContextVar("attnkit_reports", default=None)


def listening() -> bool:
    """True inside :func:`listen`, and inside a :func:`record` or :func:`patch` block that reads
    or rewrites scores or weights: attention parts then compute their weights. Code being
    compiled by ``torch.compile`` is never listened to (capture runs eagerly)."""
    if torch.compiler.is_compiling():
        return False
    return _SINK.get() is not None or hook_points.forcing()


def report(module: nn.Module, weights: Tensor | None, name: str = "weights") -> None:
    """Report ``weights`` computed by ``module`` (a no-op unless someone listens)."""
    if torch.compiler.is_compiling():
        return
    sink = _SINK.get()
    if sink is not None and weights is not None:
        sink(Report(module, name, weights.detach()))


@contextmanager
def listen(on_report: Callable[[Report], None] | None = None) -> Iterator[list[Report]]:
    """``with listen() as reports: model(x)`` collects every :class:`Report` made inside, in
    call order (or passes each to ``on_report`` as it is made, and the list stays empty).
    Blocks nest: an inner block receives the reports made inside it."""
    reports: list[Report] = []
    token = _SINK.set(reports.append if on_report is None else on_report)
    try:
        yield reports
    finally:
        _SINK.reset(token)


# Named points: record and patch.


class ActivationCache(Mapping[str, Tensor]):
    """The values recorded by :func:`record`, by full point name, in the order first emitted.

    ``cache[name]`` is the value of a point emitted once; :meth:`calls` gives every call's value
    (a layer called several times, e.g. once per decoding step).
    """

    def __init__(self) -> None:
        self._calls: dict[str, list[Tensor]] = {}

    def _store(self, name: str, value: Tensor) -> None:
        self._calls.setdefault(name, []).append(value)

    def calls(self, name: str) -> list[Tensor]:
        """Every value recorded at ``name``, one per call, in call order."""
        if name not in self._calls:
            raise KeyError(_unknown(name, self._calls, "recorded point"))
        return list(self._calls[name])

    def __getitem__(self, name: str) -> Tensor:
        values = self.calls(name)
        if len(values) > 1:
            raise ValueError(
                f"point {name!r} was recorded {len(values)} times (one per call of its layer); "
                "use cache.calls(name) for the list"
            )
        return values[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def __repr__(self) -> str:
        return f"ActivationCache({list(self._calls)})"


def _unknown(name: str, known: Collection[str], what: str) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"no {what} {name!r}{hint} ({len(known)} known)"


def _check_name(model: nn.Module, name: object, what: str) -> str:
    """``name`` if it is a point name of ``model`` (a module path and a point of POINTS)."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a point name (str), got {type(name).__name__}")
    modules = {n for n, _ in model.named_modules()}
    path, _, point = name.rpartition(".")
    if point not in POINTS or path not in modules:
        known = [f"{m}.{p}" if m else p for m in modules for p in POINTS]
        raise ValueError(
            f"{what}: {_unknown(name, known, 'point')}; a point name is a module's name in "
            f"model.named_modules() followed by one of {', '.join(POINTS)}"
        )
    return name


def _filter(model: nn.Module, names: object) -> Callable[[str], bool]:
    if names is None:
        return lambda name: True
    if callable(names):
        return names  # type: ignore[return-value]
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Collection):
        raise TypeError(
            "names must be None, a point name, a collection of point names or a function of "
            f"the name, got {type(names).__name__}"
        )
    wanted = frozenset(_check_name(model, n, "names") for n in names)
    return wanted.__contains__


@contextmanager
def record(
    model: nn.Module,
    names: str | Collection[str] | Callable[[str], bool] | None = None,
    *,
    detach: bool = True,
) -> Iterator[ActivationCache]:
    """``with record(model, names) as cache: model(x)`` keeps the values of the named points
    (:mod:`attnkit.hook_points`) that ``model``'s layers emit inside the block.

    Args:
        model: the model whose modules name the points.
        names: which points to keep: None (all), a point name, a collection of names, or a
            function of the name (``lambda n: n.endswith("weights")``).
        detach: keep detached tensors (False keeps them in the autograd graph).

    Recording scores or weights makes the attention parts compute them (a call that would run
    on SDPA runs on a kernel that returns weights: the same attention, rounded differently).
    """
    if not isinstance(detach, bool):
        raise TypeError(f"detach must be a bool, got {detach!r}")
    keep = _filter(model, names)
    cache = ActivationCache()

    def store(name: str, value: Tensor) -> None:
        cache._store(name, value.detach() if detach else value)

    with hook_points.Session(model, keep=keep, store=store):
        yield cache


def _as_patch(name: str, given: object) -> hook_points.Patch:
    if isinstance(given, Tensor):
        return lambda value: given
    if callable(given):
        return given  # type: ignore[return-value]
    raise TypeError(
        f"the patch of {name!r} must be a tensor (the replacement) or a function of the value, "
        f"got {type(given).__name__}"
    )


@contextmanager
def patch(
    model: nn.Module, patches: Mapping[str, Tensor | Callable[[Tensor], Tensor]]
) -> Iterator[None]:
    """``with patch(model, {name: fn}): model(x)`` replaces the value of each named point
    (:mod:`attnkit.hook_points`) by ``fn(value)``, or by a tensor given in place of ``fn``
    (e.g. the value recorded on another input: activation patching). The replacement keeps the
    value's shape and dtype. What follows the point is computed from the replacement: patched
    ``scores`` are aligned again (a score of −inf is a masked key), patched ``weights`` give the
    context Σ a v (Brauwers eq. 4). Patches of open blocks apply before any record sees a value.

    A patch that no layer applied inside the block is warned about on leaving it.

    Raises:
        ValueError: a name that is not a module of ``model`` followed by a point of
            :data:`attnkit.hook_points.POINTS`.
        TypeError: a patch that is neither a tensor nor callable.
    """
    if not isinstance(patches, Mapping):
        raise TypeError(f"patches must be a mapping of point names, got {type(patches).__name__}")
    fns = {_check_name(model, n, "patches"): _as_patch(n, fn) for n, fn in patches.items()}
    session = hook_points.Session(model, patches=fns)
    with session:
        yield
    missed = sorted(set(fns) - session.applied)
    if missed:
        warnings.warn(
            f"patch: no layer emitted {', '.join(map(repr, missed))} inside the block, so "
            "nothing was patched there",
            stacklevel=3,
        )


def _head_selector(heads: int | Sequence[int], value: Tensor, who: str) -> Tensor:
    """A boolean (H, 1, 1) selecting ``heads`` of a per-head value (…, H, L, d)."""
    chosen = [heads] if isinstance(heads, int) else list(heads)
    if value.dim() < 3:
        raise ValueError(f"{who}: the value of shape {tuple(value.shape)} has no head dim")
    h = value.shape[-3]
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < h:
            raise ValueError(f"{who}: head {i!r} is not one of the {h} heads (0 … {h - 1})")
    sel = torch.zeros(h, 1, 1, dtype=torch.bool, device=value.device)
    sel[chosen] = True
    return sel


def replace_heads(source: Tensor, heads: int | Sequence[int]) -> Callable[[Tensor], Tensor]:
    """A patch taking ``heads`` of a per-head point (q, k, v, scores, weights, context: head dim
    −3) from ``source`` and the other heads from the value, e.g. a head's context recorded on
    another input: ``patch(model, {name: replace_heads(cache[name], [1])})``."""
    if not isinstance(source, Tensor):
        raise TypeError(f"source must be a tensor, got {type(source).__name__}")

    def fn(value: Tensor) -> Tensor:
        if source.shape != value.shape:
            raise ValueError(
                f"replace_heads: source of shape {tuple(source.shape)} does not match the "
                f"point's value {tuple(value.shape)}"
            )
        return torch.where(_head_selector(heads, value, "replace_heads"), source, value)

    return fn


def _layer_names(model: nn.Module, layers: object, point: str, what: str) -> dict[str, object]:
    if not isinstance(layers, Mapping):
        raise TypeError(f"{what} must map module names to heads, got {type(layers).__name__}")
    return {
        _check_name(model, f"{name}.{point}" if name else point, what): given
        for name, given in layers.items()
    }


@contextmanager
def ablate_heads(model: nn.Module, heads: Mapping[str, int | Sequence[int]]) -> Iterator[None]:
    """``with ablate_heads(model, {"layers.0.self_attention.module": [1]}): model(x)`` zeroes
    the context of the given heads of each named layer (their term in concat(heads) W^O)."""
    fns = {}
    for name, chosen in _layer_names(model, heads, "context", "heads").items():

        def zero(value: Tensor, chosen=chosen) -> Tensor:
            sel = _head_selector(chosen, value, "ablate_heads")  # type: ignore[arg-type]
            return value.masked_fill(sel, 0.0)

        fns[name] = zero
    with patch(model, fns):
        yield


@contextmanager
def knock_out(
    model: nn.Module, links: Mapping[str, Tensor | Sequence[tuple[int, int]]]
) -> Iterator[None]:
    """``with knock_out(model, {"layers.0.self_attention.module": [(i, j)]}): model(x)`` stops
    query i from attending key j in the named layers: their scores become −inf and are aligned
    again, as a mask that forbids (i, j) would (Geva et al. 2023's attention knock-out).

    Each layer takes a list of (query, key) pairs, for every head, or a boolean tensor True
    where attention is knocked out, broadcastable to the scores (B, H, M, N).
    """
    fns = {}
    for name, given in _layer_names(model, links, "scores", "links").items():
        if not isinstance(given, Tensor):
            try:
                pairs = [(int(i), int(j)) for i, j in given]  # type: ignore[union-attr]
            except (TypeError, ValueError):
                raise TypeError(
                    f"knock_out: {name!r} takes (query, key) pairs or a boolean tensor, got "
                    f"{given!r}"
                ) from None
            given = pairs
        elif given.dtype != torch.bool:
            raise TypeError(
                f"knock_out: the tensor for {name!r} must be boolean, got {given.dtype}"
            )

        def knock(scores: Tensor, given=given, name=name) -> Tensor:
            if isinstance(given, Tensor):
                out = given.to(scores.device)
            else:
                m, n = scores.shape[-2:]
                out = torch.zeros(m, n, dtype=torch.bool, device=scores.device)
                for i, j in given:
                    if not (0 <= i < m and 0 <= j < n):
                        raise ValueError(
                            f"knock_out: pair ({i}, {j}) of {name!r} is outside the scores' "
                            f"{m} queries × {n} keys"
                        )
                    out[i, j] = True
            try:
                return scores.masked_fill(out, float("-inf"))
            except RuntimeError:
                raise ValueError(
                    f"knock_out: the mask of shape {tuple(out.shape)} for {name!r} does not "
                    f"broadcast to the scores {tuple(scores.shape)}"
                ) from None

        fns[name] = knock
    with patch(model, fns):
        yield
