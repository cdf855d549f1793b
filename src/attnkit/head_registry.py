"""Per-head attention parts as registered parts (DESIGN 8, 9): the registry of everything that
:class:`attnkit.MultiHeadAttention` and the Transformer layers can hold in their attention slot
by name — linear and kernelized, low-rank, hashing, routing, sparse, gated-linear, ... — each a
:class:`attnkit.HeadAttention`.

A per-head part registers its class under a snake_case name with ``@REGISTRY.register(name)``
in its own file; the class itself says how it is built at given sizes
(:meth:`attnkit.HeadAttention.for_heads`, from its ``size_arguments``) and gives a small
instance with inputs (:meth:`attnkit.HeadAttention.example`). Registering is all a new part
needs: ``attnkit run`` (:mod:`attnkit.tasks.parts`), the benchmarks and the per-head contract
suite find it here.

- ``available()``: the registered names; ``build(name, **kw)``: one built with ``kw``,
  failing loudly on an unknown name or argument (:class:`attnkit.registry.Registry`);
  ``example(name)``: ``(module, (q, k, v), kwargs)``, ``module(q, k, v, **kwargs)`` runs it.

Per-head parts are a kind of their own, with one contract (what ``HeadAttention`` declares:
``(q, k, v, *, mask, bias, need_weights) -> AttentionOutput``, capabilities as class data),
apart from the mechanisms (:mod:`attnkit.mechanisms`: whole layers with inputs and an output
family of their own). They were registered as mechanisms before: the mechanism registry
delegates to this one, so that ``attnkit.mechanisms.build("performer")``,
``mechanisms.example`` and ``mechanisms.available()`` keep every name they had, and a per-head
part registered the old way (``@attnkit.mechanisms.REGISTRY.register(name)``) lands here, with
a ``DeprecationWarning`` naming this registry.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit.head import HeadAttention
from attnkit.registry import Registry

__all__ = ["PACKAGES", "REGISTRY", "available", "build", "example"]

# The packages whose modules register per-head parts; imported on the first look-up, so that
# registering needs no import of this module's users (and no cycle).
PACKAGES = (
    "attnkit.efficient",
    "attnkit.modern",
    "attnkit.sparse_trainable",
    "attnkit.linear_family",
    "attnkit.logits",
)

REGISTRY: Registry[HeadAttention] = Registry("per-head part", packages=PACKAGES)


def available() -> list[str]:
    """The registered per-head part names."""
    return REGISTRY.available()


def build(name: str, **kwargs: Any) -> HeadAttention:
    """The per-head part ``name`` built with ``kwargs``; unknown names or arguments fail
    loudly (a keyword under a deprecated name is taken, with a warning)."""
    return REGISTRY.build(name, **kwargs)


def example(name: str) -> tuple[HeadAttention, tuple[Tensor, Tensor, Tensor], dict[str, Any]]:
    """A small built ``name`` with inputs q, k, v and keyword arguments (a key padding mask
    for a part that honours key masks): ``module(*args, **kwargs)`` runs it.

    Raises:
        ValueError: for an unknown name.
        TypeError: when the class's ``example()`` does not return ``(module, (q, k, v),
            kwargs)`` with module an instance of it.
    """
    cls = REGISTRY.get(name)
    made = cls.example()
    if not (
        isinstance(made, tuple)
        and len(made) == 3
        and isinstance(made[0], cls)
        and len(made[1]) == 3
        and isinstance(made[2], dict)
    ):
        raise TypeError(
            f"per-head part {name!r}: {cls.__qualname__}.example() must return (module, "
            f"(q, k, v), kwargs) with module a {cls.__qualname__}, got {made!r:.80}"
        )
    module, args, kwargs = made
    return module, tuple(args), dict(kwargs)
