"""attnkit: every attention mechanism of the survey taxonomy as composable PyTorch parts."""

from attnkit import (
    alignments,
    evaluation,
    features,
    hooks,
    kernels,
    masks,
    mechanisms,
    memory,
    patterns,
    positions,
    queries,
    scores,
    taxonomy,
    vision,
)
from attnkit.attention import Attention, attention
from attnkit.multihead import MultiHeadAttention
from attnkit.output import AttentionOutput
from attnkit.taxonomy import describe

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionOutput",
    "MultiHeadAttention",
    "alignments",
    "attention",
    "describe",
    "evaluation",
    "features",
    "hooks",
    "kernels",
    "masks",
    "mechanisms",
    "memory",
    "patterns",
    "positions",
    "queries",
    "scores",
    "taxonomy",
    "vision",
]
