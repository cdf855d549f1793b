"""Query-related attention mechanisms (Brauwers Sec. 3.3): query types and multiplicity of
queries (multi-hop, capsule-based, multiple outputs). Multi-head attention is
:class:`attnkit.MultiHeadAttention`."""

from attnkit.queries.attention_sum import (
    AttentionSumOutput,
    AttentionSumReader,
    occurrences,
)
from attnkit.queries.capsule import CapsuleAttention, CapsuleOutput, capsule_loss
from attnkit.queries.disan import DiSAN, DiSANOutput
from attnkit.queries.gated_heads import GatedHeadAttention, GatedHeadOutput
from attnkit.queries.history import HistoryOutput, TruncatedHistoryAttention
from attnkit.queries.multi_output import (
    ImportanceMatrixAttention,
    LabelWiseAttention,
    frobenius_penalty,
)
from attnkit.queries.multihop import MultiHop, MultiHopOutput
from attnkit.queries.pointer import PointerNetwork, PointerOutput
from attnkit.queries.query_types import QueryTagged
from attnkit.queries.self_attention import SelfAttention, SelfAttentionOutput

__all__ = [
    "AttentionSumOutput",
    "AttentionSumReader",
    "CapsuleAttention",
    "CapsuleOutput",
    "DiSAN",
    "DiSANOutput",
    "GatedHeadAttention",
    "GatedHeadOutput",
    "HistoryOutput",
    "ImportanceMatrixAttention",
    "LabelWiseAttention",
    "MultiHop",
    "MultiHopOutput",
    "PointerNetwork",
    "PointerOutput",
    "QueryTagged",
    "SelfAttention",
    "SelfAttentionOutput",
    "TruncatedHistoryAttention",
    "capsule_loss",
    "frobenius_penalty",
    "occurrences",
]
