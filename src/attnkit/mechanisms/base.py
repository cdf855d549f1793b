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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit.registry import Registry

__all__ = [
    "PACKAGES",
    "REGISTRY",
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


REGISTRY: Registry[nn.Module] = Registry("mechanism", packages=PACKAGES)


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
