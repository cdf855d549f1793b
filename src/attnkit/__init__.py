"""attnkit: every attention mechanism of the survey taxonomy as composable PyTorch parts."""

from attnkit import (
    alignments,
    evaluation,
    features,
    head_registry,
    hooks,
    kernels,
    masks,
    mechanisms,
    memory,
    patterns,
    positions,
    queries,
    regularisers,
    score_mods,
    scores,
    taxonomy,
    vision,
)
from attnkit.core import Attention, attention
from attnkit.encoder_decoder import Transformer
from attnkit.head import HeadAttention
from attnkit.kv_cache import KVCache
from attnkit.multihead import MultiHeadAttention
from attnkit.output import AttentionOutput
from attnkit.taxonomy import describe
from attnkit.torch_compat import TorchMultiheadAttention
from attnkit.transformer import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__version__ = "0.1.0"


# Subpackages loaded on first use (``ak.efficient.Performer``), so that ``import attnkit`` stays
# light; ``import attnkit.efficient`` works as well.
_LAZY = (
    "distributed",
    "efficient",
    "experiments",
    "integrations",
    "linear_family",
    "logits",
    "mixers",
    "models",
    "modern",
    "sparse_trainable",
    "tasks",
    "training",
)


def __getattr__(name: str):
    # load_run reaches the tasks and the experiment tool, which import the parts: load it on use.
    if name == "load_run":
        from attnkit.experiments.reload import load_run

        return load_run
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"attnkit.{name}")
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")


__all__ = [
    "Attention",
    "AttentionOutput",
    "HeadAttention",
    "KVCache",
    "MultiHeadAttention",
    "TorchMultiheadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "alignments",
    "attention",
    "describe",
    "distributed",
    "efficient",
    "evaluation",
    "experiments",
    "features",
    "head_registry",
    "hooks",
    "integrations",
    "kernels",
    "linear_family",
    "load_run",
    "logits",
    "masks",
    "mechanisms",
    "memory",
    "mixers",
    "models",
    "modern",
    "patterns",
    "positions",
    "queries",
    "regularisers",
    "score_mods",
    "scores",
    "sparse_trainable",
    "tasks",
    "taxonomy",
    "training",
    "vision",
]
