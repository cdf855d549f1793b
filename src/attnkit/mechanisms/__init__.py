"""Mechanisms as registered parts (DESIGN 7): anything that attends and is not the core's single
score → align → weighted-sum slot — co-attention, rotatory, levels, meta-embeddings, capsules,
multiple outputs, multi-hop, self-attention, and later the efficient and memory families.

``available()`` lists the registered names; ``build(name, **kw)`` constructs one, failing loudly
on unknown names or arguments; ``example(name)`` gives a small built instance with example
inputs, ``(module, args, kwargs)``. Every mechanism returns a :class:`MechanismOutput`.

Per-head attention parts (:class:`attnkit.HeadAttention`) are registered in
:mod:`attnkit.head_registry`; this registry delegates to it, so their names are listed, built
and exemplified here too (:class:`attnkit.mechanisms.base.MechanismRegistry`).
"""

from attnkit.mechanisms.base import (
    PACKAGES,
    REGISTRY,
    MechanismRegistry,
    available,
    build,
    example,
    example_tensor,
)
from attnkit.mechanisms.output import MechanismOutput

__all__ = [
    "PACKAGES",
    "REGISTRY",
    "MechanismOutput",
    "MechanismRegistry",
    "available",
    "build",
    "example",
    "example_tensor",
]
