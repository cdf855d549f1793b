"""Attention as today's large models use it, one file per concept: multi-head latent attention
(DeepSeek-V2/V3) with its latent KV cache and absorbed decoding form, differential attention
(Diff Transformer), a learned sink logit per head (GPT-OSS) and StreamingLLM's sinks-and-window
cache. The attention parts are registered mechanisms; the sink and differential parts fit the
attention slot of :class:`attnkit.MultiHeadAttention`, latent attention is a whole layer."""

from attnkit.modern.differential import DifferentialAttention, lambda_init
from attnkit.modern.gated_output import GATE_KINDS, OutputGate
from attnkit.modern.latent import (
    LatentCache,
    LatentOutput,
    MultiHeadLatentAttention,
    cache_bytes_per_token,
)
from attnkit.modern.sinks import SinkAttention, SinkSoftmax, sink_softmax
from attnkit.modern.streaming import StreamingCache, streaming_mask

__all__ = [
    "GATE_KINDS",
    "DifferentialAttention",
    "LatentCache",
    "LatentOutput",
    "MultiHeadLatentAttention",
    "OutputGate",
    "SinkAttention",
    "SinkSoftmax",
    "StreamingCache",
    "cache_bytes_per_token",
    "lambda_init",
    "sink_softmax",
    "streaming_mask",
]
