"""Mechanisms as registered parts (DESIGN 7): anything that attends and is not the core's single
score → align → weighted-sum slot — co-attention, rotatory, levels, meta-embeddings, capsules,
multiple outputs, multi-hop, self-attention, and later the efficient and memory families.

A mechanism registers its class under a name with ``@REGISTRY.register(name)`` in its own file,
and provides ``example()``: a small built instance with example inputs, ``(module, args,
kwargs)``, batch first with B ≥ 2, so that the contract suite (and any check outside it) can
call every mechanism without a hand-written list. It declares ``mask_inputs``: each forward argument
that is a padding mask, with the inputs (…, n, d) whose n rows it covers, so that the suite can
test mask == truncation.

Every mechanism returns a member of one output family,
:class:`attnkit.mechanisms.MechanismOutput`: a typed (named) tuple with ``representation`` — the
tensor the mechanism produces for the next layer — and ``named_weights()`` — its attention
weights by name. Its weights are computed through the core (:class:`attnkit.Attention`) or
reported to :mod:`attnkit.hooks` by the mechanism, so ``attnkit.evaluation.capture`` sees them.

Per-head attention parts (:class:`attnkit.HeadAttention`) have a registry of their own,
:mod:`attnkit.head_registry`, and their own contract. This registry delegates to it: a name it
does not hold is looked up there, so ``build``, ``example`` and ``REGISTRY.get`` take every
per-head part's name as they did when per-head parts were registered here, and ``available()``
lists them too (everything that attends, by name). :meth:`MechanismRegistry.own` names the
mechanisms registered here themselves, those the mechanism contract covers. A per-head part
registered here the old way is registered there instead, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from attnkit import head_registry
from attnkit.head import HeadAttention
from attnkit.registry import Registry

__all__ = [
    "PACKAGES",
    "REGISTRY",
    "MechanismRegistry",
    "available",
    "build",
    "example",
    "example_tensor",
]


# The packages whose modules register mechanisms; imported on first use, so that registering
# needs no import of this module's users (and no cycle).
PACKAGES = (
    "attnkit.features",
    "attnkit.queries",
    "attnkit.memory",
    "attnkit.efficient",
    "attnkit.vision",
    "attnkit.modern",
    "attnkit.sparse_trainable",
    "attnkit.linear_family",
    "attnkit.logits",
)


M = TypeVar("M", bound=nn.Module)


class MechanismRegistry(Registry[nn.Module]):
    """The mechanism registry, delegating per-head parts to :mod:`attnkit.head_registry`.

    Its own table holds the mechanisms; a name not in it is looked up among the per-head parts
    (:meth:`get`, and so ``build``, ``example`` and ``accepts``), and :meth:`available` lists
    both. A :class:`attnkit.HeadAttention` subclass given to :meth:`register` is registered
    with the per-head parts, with a ``DeprecationWarning``: each kind has its one registry.
    """

    def __init__(self, kind: str, *, packages: tuple[str, ...], heads: Registry[HeadAttention]):
        super().__init__(kind, packages=packages)
        self.heads = heads

    def register(self, name: str, *, override: bool = False) -> Callable[[type[M]], type[M]]:
        mine = super().register(name, override=override)
        theirs = self.heads.register(name, override=override)

        def decorate(cls: type[M]) -> type[M]:
            if isinstance(cls, type) and issubclass(cls, HeadAttention):
                warnings.warn(
                    f"{cls.__qualname__} is a per-head attention part: register it with "
                    f"attnkit.head_registry.REGISTRY.register({name!r}) (per-head parts have "
                    "their own registry; it was registered there)",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return theirs(cls)  # type: ignore[arg-type, return-value]
            return mine(cls)

        return decorate

    def own(self) -> list[str]:
        """The names registered here as mechanisms (not the per-head parts delegated to)."""
        return super().available()

    def available(self) -> list[str]:
        """Every name :meth:`get` takes: the mechanisms and the per-head parts."""
        return sorted({*super().available(), *self.heads.available()})

    def get(self, name: str) -> type[nn.Module]:
        if isinstance(name, str) and name not in self._table:
            self.load()
            if name not in self._table and name in self.heads.available():
                return self.heads.get(name)
        return super().get(name)


REGISTRY: MechanismRegistry = MechanismRegistry(
    "mechanism", packages=PACKAGES, heads=head_registry.REGISTRY
)


def _load() -> None:
    REGISTRY.load()


def available() -> list[str]:
    """The registered mechanism names."""
    _load()
    return REGISTRY.available()


def build(name: str, **kwargs: Any) -> nn.Module:
    """The mechanism ``name`` built with ``kwargs``; unknown names or arguments fail loudly."""
    _load()
    return REGISTRY.build(name, **kwargs)


def example(name: str) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """A small built ``name`` with example inputs: ``module(*args, **kwargs)`` runs it."""
    _load()
    cls = REGISTRY.get(name)
    make = getattr(cls, "example", None)
    if make is None:
        raise TypeError(
            f"mechanism {name!r} ({cls.__qualname__}) has no example(): give it a classmethod "
            "returning (module, args, kwargs)"
        )
    made = make()
    if not (isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], cls)):
        raise TypeError(
            f"mechanism {name!r}: {cls.__qualname__}.example() must return (module, args, "
            f"kwargs) with module a {cls.__qualname__}, got {type(made).__name__}"
        )
    module, args, kwargs = made
    return module, tuple(args), dict(kwargs)


def example_tensor(*shape: int, seed: int = 0) -> Tensor:
    """A reproducible standard-normal float32 tensor for ``example()`` inputs."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
