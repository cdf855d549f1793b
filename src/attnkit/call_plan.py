"""A multi-head layer's plan for one kind of call: resolved once, then trusted (DESIGN 8, 9).

Everything a :class:`attnkit.MultiHeadAttention` call checks and chooses, except the sizes,
follows from the call's *kind* (:func:`call_kind`): the dtype, device and rank of each input,
which inputs are one tensor (self-attention), whether a mask and a bias are given (with their
dtype, device and rank), whether weights are asked for, the type of the cache and whether the
layer is training. The first call of a kind is validated in full at the layer's door; the layer
then keeps a :class:`LayerPlan` for the kind, which records what it resolved:

- that the parameters match the inputs' dtype and device, the part takes the call's mask form,
  bias and cache, and the call's options are valid (nothing of this is checked again);
- whether the q/k chain and the position scheme have anything to do (``places``);
- whether the caller's mask is the part's mask as it is (``plain_mask``: no pattern or layer
  ``score_mod``, a part whose queries do not share computation);
- whether the part evaluates its calls directly (``direct``, :meth:`attnkit.Attention.direct`:
  SDPA without selecting a kernel again);
- what the layer tells the part about each call (``facts``, :func:`part_facts`): that its
  inputs were validated at the layer's door (``checked``) and, for a layer whose callers state
  their inputs finite (``MultiHeadAttention.inputs_finite``), that no key or value is NaN or
  infinite (``finite``). These are keywords of the part's call, not a switch around it.

A later call of the kind checks only its sizes (:func:`fits`); a call whose sizes the quick
check cannot confirm is validated in full again, so its error, if any, is the full check's.
Calls outside plans (a ``block_mask``, a per-call ``score_mod``, a ``memory_cache``, an
unbatched query) are validated in full each time.

A plan is dropped when the layer is moved or converted (``.to()``, ``.double()``, ...) or one
of its attributes is set, and is not copied with the layer; the direct route reads the part's
score, alignment and kernel at every call, and steps aside when a kernel is registered that
selection would try before SDPA (:meth:`attnkit.kernels.base.KernelRegistry.first`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attnkit.core import Attention
from attnkit.positions.none import NoPosition

__all__ = ["LayerPlan", "call_kind", "fits", "part_facts"]


def _described(x: Tensor) -> tuple[Any, ...]:
    return (x.dtype, x.device, x.dim())


def call_kind(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    need_weights: object,
    cache: object,
    training: bool,
) -> tuple[Any, ...] | None:
    """The kind of a batched call (see the module's text), or None for a call that plans do
    not cover: an input that is not a tensor, ``need_weights`` that is not a bool, or a query
    without a batch dim."""
    if type(need_weights) is not bool:
        return None
    try:
        if query.dim() < 3:
            return None
        return (
            *_described(query),
            None if key is query else _described(key),
            None if value is key else _described(value),
            None if mask is None else _described(mask),
            None if bias is None else _described(bias),
            need_weights,
            type(cache),
            training,
        )
    except (AttributeError, TypeError):
        return None


def part_facts(layer: Any) -> dict[str, bool]:
    """The keywords with which ``layer`` (a :class:`attnkit.MultiHeadAttention` whose door has
    validated the call) calls its per-head part: ``checked=True`` (the part reads only the
    sizes) and ``finite`` (the layer's ``inputs_finite``); none for a part whose own
    ``forward`` does not take them (:attr:`attnkit.HeadAttention.forward_takes_facts`), which
    then validates the call itself."""
    if not layer.attention.forward_takes_facts:
        return {}
    return {"checked": True, "finite": layer.inputs_finite}


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` has the rank of ``target`` and broadcasts to it."""
    return len(shape) == len(target) and all(
        a == b or a == 1 for a, b in zip(shape, target, strict=True)
    )


def fits(
    layer: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    cached: int,
) -> bool:
    """Whether the sizes of a call of a planned kind certainly pass the layer's checks: the
    feature sizes, equal batch dims of query, key and value, at least one key, and a mask and
    bias that broadcast to (B, …, M, N) or (B, …, H, M, N) with every dim given, or (M, N).
    False leaves the call to the full checks (which accept what broadcasts in other ways)."""
    if query.shape[-1] != layer.embed_dim:
        return False
    n = key.shape[-2] + cached
    if n < 1:
        return False
    lead = query.shape[:-2]
    if key is not query and (
        key.shape[-1] != layer.kdim
        or value.shape[-1] != layer.vdim
        or key.shape[:-1] != value.shape[:-1]
        or key.shape[:-2] != lead
    ):
        return False
    m = query.shape[-2]
    for x in (mask, bias):
        if x is None:
            continue
        shape = x.shape
        if len(shape) == 2:
            if not _broadcasts(shape, (m, n)):
                return False
        elif len(shape) == len(lead) + 2:
            if not _broadcasts(shape, (*lead, m, n)):
                return False
        elif not _broadcasts(shape, (*lead, layer.num_heads, m, n)):
            return False
    return True


@dataclass(frozen=True)
class LayerPlan:
    """What a layer resolved for one kind of call (see the module's text).

    Attributes:
        places: the q/k chain or the position scheme may change q or k, or add a bias or a
            term on the values.
        plain_mask: the caller's mask, per head, is the part's mask.
        direct: the part may evaluate the call directly (:meth:`attnkit.Attention.direct`).
        heads_alike: the q/k chain's steps and the position scheme do the same to every head
            (``same_for_every_head``): a grouped-query layer places each key head once.
        finite: the layer's callers state its inputs finite (``inputs_finite``): masked keys
            are neither looked at nor cleared, on the direct route too.
        facts: the keywords of the part's call that say what the layer knows
            (:func:`part_facts`).
    """

    places: bool
    plain_mask: bool
    direct: bool
    heads_alike: bool
    finite: bool
    facts: dict[str, bool]

    @classmethod
    def resolve(cls, layer: Any, need_weights: bool) -> LayerPlan:
        """The plan of ``layer`` (a :class:`attnkit.MultiHeadAttention`) for calls of a kind
        that its door has just validated."""
        part = layer.attention
        plain_mask = layer.pattern is None and layer.score_mod is None and not part.mixes_queries
        return cls(
            places=len(layer.qk) > 0 or not isinstance(layer.position, NoPosition),
            plain_mask=plain_mask,
            direct=(
                plain_mask
                and not need_weights
                and isinstance(part, Attention)
                and type(part).forward is Attention.forward
                and type(part).direct is Attention.direct
            ),
            heads_alike=layer._heads_alike(),
            finite=layer.inputs_finite,
            facts=part_facts(layer),
        )
