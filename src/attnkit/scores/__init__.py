"""Score functions (Brauwers Sec. 3.2.1, Table II; Galassi IV-B), one small module each.

``available()`` lists the registered names; ``build(name, **kw)`` constructs one, failing loudly
on unknown names or arguments.
"""

from attnkit.scores.additive import Additive, Concat, Deep
from attnkit.scores.base import REGISTRY, Score
from attnkit.scores.decomposable import Decomposable, SharedDecomposable
from attnkit.scores.hermitian import DirectedHermitian, Hermitian
from attnkit.scores.multiplicative import ActivatedGeneral, BiasedGeneral, Dot, General, ScaledDot
from attnkit.scores.positional import Convolutional, Location
from attnkit.scores.self_attentive import LearnedQuery
from attnkit.scores.similarity import Cosine, Euclidean

available = REGISTRY.available
build = REGISTRY.build

__all__ = [
    "REGISTRY",
    "ActivatedGeneral",
    "Additive",
    "BiasedGeneral",
    "Concat",
    "Convolutional",
    "Cosine",
    "Decomposable",
    "Deep",
    "DirectedHermitian",
    "Dot",
    "Euclidean",
    "General",
    "Hermitian",
    "LearnedQuery",
    "Location",
    "ScaledDot",
    "Score",
    "SharedDecomposable",
    "available",
    "build",
]
