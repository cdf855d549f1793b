"""Position schemes for the position slot of multi-head attention and the Transformer layers.

``available()`` lists the registered names; ``build(name, **kw)`` constructs one, failing loudly
on unknown names or arguments.
"""

from attnkit.positions.base import (
    REGISTRY,
    AbsolutePosition,
    Positioned,
    PositionScheme,
    relative_distances,
)
from attnkit.positions.none import NoPosition

available = REGISTRY.available
build = REGISTRY.build

__all__ = [
    "REGISTRY",
    "AbsolutePosition",
    "NoPosition",
    "PositionScheme",
    "Positioned",
    "available",
    "build",
    "relative_distances",
]
