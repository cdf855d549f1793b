"""Named hook points: the activations an attention layer emits, to be read and rewritten.

A layer passes each of its activations through this module at a named *point*; with no
:func:`attnkit.hooks.record` or :func:`attnkit.hooks.patch` block open anywhere the value is
returned as it is after one check of a module-level counter, so an unhooked model pays a few
function calls per layer. Inside a block, a point's full name is the emitting module's name in
``model.named_modules()`` followed by the point, e.g. ``"layers.0.self_attention.module.weights"``.

The points (:data:`POINTS`), per head where the tensor has heads:

- ``q`` (B, H, M, d), ``k`` and ``v`` (B, H_kv, N, d): the per-head projections Q W^Q, K W^K,
  V W^V of this call (Brauwers eq. 38), before a position scheme or a q/k transform rewrites
  them and before a KV cache extends the keys. For a swapped ``transformers`` model they are the
  tensors the model hands its attention function (after its own rotary embedding; k and v
  repeated to H heads).
- ``scores`` (B, H, M, N): the scores e the alignment reads (after any bias and score_mod).
- ``weights`` (B, H, M, N): the attention weights a = align(e).
- ``context`` (B, H, M, d_v): each head's context Σ a v, before the heads are concatenated.
- ``output`` (B, M, E): the layer's output, concat(heads) W^O.

A patched ``scores`` is aligned again with the part's alignment, a score set to −inf counting as
a masked key (so a knock-out equals a mask for every alignment); patched ``weights`` give the
context Σ a v again (without dropout). Parts that return no scores or weights (e.g. on the SDPA
path outside a block) are made to return them while a block records or patches those points
(:func:`attnkit.hooks.listening` is then True).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.output import AttentionOutput

__all__ = ["POINTS", "Session", "attention", "emit", "forcing", "output_from_forward", "qkv"]

#: The points every attention layer emits, in the order of its computation.
POINTS = ("q", "k", "v", "scores", "weights", "context", "output")

Patch = Callable[[Tensor], Tensor]

_ACTIVE = 0  # blocks open in any thread: the unhooked path reads only this
_LOCK = threading.Lock()
_SESSIONS: ContextVar[tuple[Session, ...]] = ContextVar("attnkit_hook_points", default=())
# Modules whose ``output`` point is their forward's first result, read by a forward hook that
# an open block installs (attention modules of other libraries, which attnkit calls inside).
_BY_FORWARD: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_HOOKS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, int]] = weakref.WeakKeyDictionary()


def output_from_forward(modules: Iterable[nn.Module]) -> None:
    """Give ``modules`` an ``output`` point: the first value their forward returns (or the
    value itself when it is a tensor), through a forward hook that exists only while a
    :func:`attnkit.hooks.record` or :func:`attnkit.hooks.patch` block is open."""
    for module in modules:
        _BY_FORWARD.add(module)


def _forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, Tensor):
        return emit(module, "output", output)
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return (emit(module, "output", output[0]), *output[1:])
    return None


class Session:
    """What one open block does at the points of one model's modules.

    Args:
        model: the module whose submodules are named (by ``model.named_modules()``).
        patches: full point name -> a function of the value giving its replacement.
        keep: which full point names are recorded (None: none).
        store: called with (full name, value) for every recorded point.
    """

    def __init__(
        self,
        model: nn.Module,
        patches: dict[str, Patch] | None = None,
        keep: Callable[[str], bool] | None = None,
        store: Callable[[str, Tensor], None] | None = None,
    ) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.patches = dict(patches or {})
        self.keep, self.store = keep, store
        self.applied: set[str] = set()
        # Whether parts must compute their weights: a scores/weights point is patched or kept.
        wanted = {p.rsplit(".", 1)[-1] for p in self.patches}
        if keep is not None:
            wanted |= {
                point
                for name in self.names.values()
                for point in ("scores", "weights")
                if keep(_join(name, point))
            }
        self.weights = bool(wanted & {"scores", "weights"})

    def name(self, module: nn.Module, point: str) -> str | None:
        """The full name of ``point`` of ``module``, or None for a module outside the model."""
        base = self.names.get(id(module))
        return None if base is None else _join(base, point)

    def patched(self, module: nn.Module, point: str) -> bool:
        name = self.name(module, point)
        return name is not None and name in self.patches

    def patch(self, module: nn.Module, point: str, value: Tensor) -> Tensor:
        name = self.name(module, point)
        fn = None if name is None else self.patches.get(name)
        if fn is None:
            return value
        self.applied.add(name)  # type: ignore[arg-type]
        new = fn(value)
        if not isinstance(new, Tensor):
            raise TypeError(f"the patch of {name!r} returned {type(new).__name__}, not a tensor")
        if new.shape != value.shape:
            raise ValueError(
                f"the patch of {name!r} returned shape {tuple(new.shape)}; the point's value "
                f"has shape {tuple(value.shape)}"
            )
        if new.dtype != value.dtype:
            raise TypeError(
                f"the patch of {name!r} returned dtype {new.dtype}; the point's value has "
                f"{value.dtype}"
            )
        return new

    def record(self, module: nn.Module, point: str, value: Tensor) -> None:
        if self.keep is None or self.store is None:
            return
        name = self.name(module, point)
        if name is not None and self.keep(name):
            self.store(name, value)

    def __enter__(self) -> Session:
        global _ACTIVE
        self._token = _SESSIONS.set((*_SESSIONS.get(), self))
        with _LOCK:
            _ACTIVE += 1
            self._hooked = [m for m in list(_BY_FORWARD) if id(m) in self.names]
            for m in self._hooked:  # one forward hook per module, however many blocks are open
                handle, count = _HOOKS.get(m, (None, 0))
                _HOOKS[m] = (handle or m.register_forward_hook(_forward_hook), count + 1)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        with _LOCK:
            _ACTIVE -= 1
            for m in self._hooked:
                handle, count = _HOOKS.pop(m)
                if count > 1:
                    _HOOKS[m] = (handle, count - 1)
                else:
                    handle.remove()
        _SESSIONS.reset(self._token)


def _join(module_name: str, point: str) -> str:
    return f"{module_name}.{point}" if module_name else point


def _sessions() -> tuple[Session, ...]:
    """The open blocks of this context (none while ``torch.compile`` traces: hooks run eagerly)."""
    if torch.compiler.is_compiling():
        return ()
    return _SESSIONS.get()


def _through(sessions: tuple[Session, ...], module: nn.Module, point: str, value: Tensor) -> Tensor:
    """The value after every open block's patch of the point (outermost first), recorded by every
    block after all patches: a record sees what flows on."""
    for s in sessions:
        value = s.patch(module, point, value)
    for s in sessions:
        s.record(module, point, value)
    return value


def forcing() -> bool:
    """True while an open block records or patches scores or weights (parts then compute them)."""
    return bool(_ACTIVE) and any(s.weights for s in _sessions())


def emit(module: nn.Module, point: str, value: Tensor) -> Tensor:
    """``value`` after the open blocks' patches of ``point`` of ``module`` (recorded by them);
    ``value`` itself when no block is open."""
    if not _ACTIVE:
        return value
    sessions = _sessions()
    return _through(sessions, module, point, value) if sessions else value


def qkv(module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The points ``q``, ``k`` and ``v`` of ``module`` (see :func:`emit`)."""
    if not _ACTIVE:
        return q, k, v
    sessions = _sessions()
    if not sessions:
        return q, k, v
    return tuple(_through(sessions, module, p, x) for p, x in (("q", q), ("k", k), ("v", v)))  # type: ignore[return-value]


def attention(
    module: nn.Module,
    out: AttentionOutput,
    q: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    align: nn.Module | None = None,
    block_mask: Any = None,
) -> AttentionOutput:
    """The points ``scores`` and ``weights`` of a per-head attention call of ``module``.

    Args:
        out: the part's output for q (…, H, M, d) and v (…, H, N, d_v).
        mask: the boolean mask the part was given (True = may attend).
        align: the part's alignment, to align patched scores again (None: scores cannot be
            patched).
        block_mask: the block mask the part was given, combined with ``mask`` when aligning.

    Returns:
        ``out`` with the patched scores and weights, and the context Σ a v of patched weights.
    """
    if not _ACTIVE:
        return out
    sessions = _sessions()
    if not sessions:
        return out
    scores, weights = out.scores, out.weights
    who = f"{type(module).__name__}'s attention part"
    for point, value in (("scores", scores), ("weights", weights)):
        if value is None and any(s.patched(module, point) for s in sessions):
            raise ValueError(
                f"cannot patch {point}: {who} returned no {point} (parts without a score "
                "matrix, e.g. linear attention, or the chunked kernel's block-wise weights)"
            )
    if scores is not None:
        new = _through(sessions, module, "scores", scores)
        if new is not scores:
            weights = _realign(new, q, v, mask, align, block_mask, who)
        scores = new
    if weights is not None:
        new = _through(sessions, module, "weights", weights)
        if new is not out.weights:
            if new.dim() != v.dim() or new.shape[-1] != v.shape[-2]:
                raise ValueError(
                    f"cannot recompute the context from weights of shape {tuple(new.shape)} and "
                    f"values {tuple(v.shape)}: patching needs (…, M, N) weights (single-"
                    "dimensional attention)"
                )
            context = torch.matmul(new.to(v.dtype), v)  # Brauwers eq. 4
            out = out._replace(context=context)
        weights = new
    return out._replace(scores=scores, weights=weights)


def _realign(
    scores: Tensor,
    q: Tensor,
    v: Tensor,
    mask: Tensor | None,
    align: nn.Module | None,
    block_mask: Any,
    who: str,
) -> Tensor:
    """The weights of patched scores: the alignment over the keys the call's mask allows and
    whose score is not −inf."""
    if align is None:
        raise ValueError(
            f"cannot patch scores: {who} has no alignment to apply to them; patch weights instead"
        )
    if scores.dim() != v.dim():
        raise ValueError(
            f"cannot patch scores of shape {tuple(scores.shape)}: patching needs (…, M, N) scores "
            "(single-dimensional attention)"
        )
    keep = scores != float("-inf")
    if block_mask is not None:
        keep = keep & block_mask.to_dense()
    if mask is not None:
        keep = keep & mask
    weights, _ = align(scores.masked_fill(~keep, 0.0), keep, query=q)
    return weights.to(scores.dtype)
