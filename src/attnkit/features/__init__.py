"""Feature-related attention mechanisms (Brauwers Sec. 3.1): multiplicity of features
(co-attention, rotatory), feature levels, feature representations."""

from attnkit.features.coattention import (
    AlternatingCoAttention,
    CoAttentionOutput,
    InteractiveCoAttention,
    MultiGrainedCoAttention,
    NestedCoAttention,
    ParallelCoAttention,
)
from attnkit.features.decomposable import DecomposableAttention, DecomposableOutput
from attnkit.features.gated_merge import GatedMerge, GatedMergeOutput
from attnkit.features.levels import AttentionViaAttention, HierarchicalAttention
from attnkit.features.query_coattention import QueryGuidedCoAttention
from attnkit.features.representations import MetaEmbedding
from attnkit.features.rotatory import RotatoryAttention
from attnkit.features.target_document import TargetDocumentAttention, TargetDocumentOutput

__all__ = [
    "AlternatingCoAttention",
    "AttentionViaAttention",
    "CoAttentionOutput",
    "DecomposableAttention",
    "DecomposableOutput",
    "GatedMerge",
    "GatedMergeOutput",
    "HierarchicalAttention",
    "InteractiveCoAttention",
    "MetaEmbedding",
    "MultiGrainedCoAttention",
    "NestedCoAttention",
    "ParallelCoAttention",
    "QueryGuidedCoAttention",
    "RotatoryAttention",
    "TargetDocumentAttention",
    "TargetDocumentOutput",
]
