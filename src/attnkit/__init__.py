"""attnkit: every attention mechanism of the survey taxonomy as composable PyTorch parts."""

from attnkit import alignments, masks, scores
from attnkit.attention import Attention, attention
from attnkit.multihead import MultiHeadAttention
from attnkit.output import AttentionOutput

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionOutput",
    "MultiHeadAttention",
    "alignments",
    "attention",
    "masks",
    "scores",
]
