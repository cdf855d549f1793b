"""Position schemes for the position slot of multi-head attention and the Transformer layers.

``available()`` lists the registered names; ``build(name, **kw)`` constructs one, failing loudly
on unknown names or arguments.
"""

from attnkit.positions.alibi import ALiBi, alibi_slopes
from attnkit.positions.base import (
    REGISTRY,
    AbsolutePosition,
    Positioned,
    PositionScheme,
    relative_distances,
)
from attnkit.positions.gated_transformer_xl import (
    GatedTransformerXL,
    GatedTransformerXLLayer,
    GRUGate,
)
from attnkit.positions.learned import Learned
from attnkit.positions.music import MusicRelative, skew
from attnkit.positions.none import NoPosition
from attnkit.positions.rope import Rotary, rotate
from attnkit.positions.rope_scaling import ScaledRotary
from attnkit.positions.shaw import ShawRelative
from attnkit.positions.sinusoidal import Sinusoidal, sinusoid_table
from attnkit.positions.t5 import T5Relative, t5_bucket
from attnkit.positions.transformer_xl import TransformerXL, TransformerXLLayer, XLRelative
from attnkit.positions.xpos import XPos, xpos_scales

available = REGISTRY.available
build = REGISTRY.build

__all__ = [
    "REGISTRY",
    "ALiBi",
    "AbsolutePosition",
    "GRUGate",
    "GatedTransformerXL",
    "GatedTransformerXLLayer",
    "Learned",
    "MusicRelative",
    "NoPosition",
    "PositionScheme",
    "Positioned",
    "Rotary",
    "ScaledRotary",
    "ShawRelative",
    "Sinusoidal",
    "T5Relative",
    "TransformerXL",
    "TransformerXLLayer",
    "XLRelative",
    "XPos",
    "alibi_slopes",
    "available",
    "build",
    "relative_distances",
    "rotate",
    "sinusoid_table",
    "skew",
    "t5_bucket",
    "xpos_scales",
]
