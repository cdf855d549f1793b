"""Trainable sparse attention: parts that learn which keys each query reads and whose cost
follows that selection — Native Sparse Attention (compressed, selected and sliding-window
branches under learned gates), DeepSeek Sparse Attention (a lightning indexer choosing the
top-k keys) and Mixture of Block Attention (each query routing itself to the top-k key blocks by
their mean key). Each is a registered mechanism and a causal per-head part for
``MultiHeadAttention(attention=...)``."""

from attnkit.sparse_trainable.deepseek_v32 import SparseLatentAttention, SparseLatentCache
from attnkit.sparse_trainable.dsa import DeepSeekSparseAttention, LightningIndexer
from attnkit.sparse_trainable.moba import MixtureOfBlockAttention
from attnkit.sparse_trainable.nsa import (
    BlockCompression,
    MeanCompression,
    NativeSparseAttention,
    NSABranches,
)

__all__ = [
    "BlockCompression",
    "DeepSeekSparseAttention",
    "LightningIndexer",
    "MeanCompression",
    "MixtureOfBlockAttention",
    "NSABranches",
    "NativeSparseAttention",
    "SparseLatentAttention",
    "SparseLatentCache",
]
