"""Alignment (distribution) functions (Brauwers Sec. 3.2.2; Galassi IV-C), one small module each.

``available()`` lists the registered names; ``build(name, **kw)`` constructs one, failing loudly
on unknown names or arguments.
"""

from attnkit.alignments.base import (
    REGISTRY,
    Alignment,
    AlignOutput,
    masked_log_softmax,
    masked_softmax,
)
from attnkit.alignments.constrained import ConstrainedSoftmax, ConstrainedSparsemax
from attnkit.alignments.graph import GraphLocal, tree_distance
from attnkit.alignments.hard import Hard
from attnkit.alignments.local import Local
from attnkit.alignments.localness import PredictedWindow
from attnkit.alignments.per_head import PerHead
from attnkit.alignments.reinforced import Reinforced
from attnkit.alignments.sigmoid import Sigmoid
from attnkit.alignments.softmax import Softmax
from attnkit.alignments.sparse import Entmax, Entmax15, Sparsemax
from attnkit.alignments.structured import Structured
from attnkit.alignments.temperature import QueryTemperature
from attnkit.alignments.uniform import Uniform

available = REGISTRY.available
build = REGISTRY.build

__all__ = [
    "REGISTRY",
    "AlignOutput",
    "Alignment",
    "ConstrainedSoftmax",
    "ConstrainedSparsemax",
    "Entmax",
    "Entmax15",
    "GraphLocal",
    "Hard",
    "Local",
    "PerHead",
    "PredictedWindow",
    "QueryTemperature",
    "Reinforced",
    "Sigmoid",
    "Softmax",
    "Sparsemax",
    "Structured",
    "Uniform",
    "available",
    "build",
    "masked_log_softmax",
    "masked_softmax",
    "tree_distance",
]
