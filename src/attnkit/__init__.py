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
    regularisers,
    scores,
    taxonomy,
    vision,
)
from attnkit.attention import Attention, attention
from attnkit.encoder_decoder import Transformer
from attnkit.kv_cache import KVCache
from attnkit.multihead import MultiHeadAttention
from attnkit.output import AttentionOutput
from attnkit.taxonomy import describe
from attnkit.transformer import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionOutput",
    "KVCache",
    "MultiHeadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
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
    "regularisers",
    "scores",
    "taxonomy",
    "vision",
]
