"""Attention as today's large models use it, one file per concept: multi-head latent attention
(DeepSeek-V2/V3) with its latent KV cache and absorbed decoding form, differential attention
(Diff Transformer), a learned sink logit per head (GPT-OSS), StreamingLLM's sinks-and-window
cache, gated attention (Qwen3-Next) and forgetting attention (FoX). The attention parts are
registered mechanisms; the sink, differential and forgetting parts fit the attention slot of
:class:`attnkit.MultiHeadAttention`, latent and gated attention are whole layers."""

from attnkit.modern.differential import DifferentialAttention, lambda_init
from attnkit.modern.forgetting import ForgettingAttention, forgetting_bias
from attnkit.modern.gated_attention import GatedAttention
from attnkit.modern.latent import (
    LatentCache,
    LatentOutput,
    MultiHeadLatentAttention,
    cache_bytes_per_token,
)
from attnkit.modern.sinks import SinkAttention, SinkSoftmax, sink_softmax
from attnkit.modern.streaming import StreamingCache, streaming_mask

__all__ = [
    "DifferentialAttention",
    "ForgettingAttention",
    "GatedAttention",
    "LatentCache",
    "LatentOutput",
    "MultiHeadLatentAttention",
    "SinkAttention",
    "SinkSoftmax",
    "StreamingCache",
    "cache_bytes_per_token",
    "forgetting_bias",
    "lambda_init",
    "sink_softmax",
    "streaming_mask",
]
