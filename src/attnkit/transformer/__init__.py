"""Transformer blocks (Vaswani et al.) from attnkit parts, with any score × alignment: multi-head
self-attention + residual + norm + feed-forward (encoder), and causal self-attention +
cross-attention (decoder). Brauwers 3.3.2 reads a stack of them as multi-head + multi-hop.

A stack may hold a different token mixing per layer (a hybrid: Gated DeltaNet and attention
layers, sliding-window and global ones, Mamba-2 mixers, ...): its ``layers`` is then a plan
(:mod:`attnkit.layer_plan`), and a decoder's cache holds each layer's own kind of state.

One concept per module: :mod:`attnkit.transformer.encoder_layer` and
:mod:`attnkit.transformer.decoder_layer` (the layers), :mod:`attnkit.transformer.encoder` and
:mod:`attnkit.transformer.decoder` (the stacks), with what they share in
:mod:`attnkit.transformer.block` (the layers' common part), :mod:`attnkit.transformer.stack`
(building a plan's layers) and :mod:`attnkit.transformer.feed_forward`."""

from attnkit.transformer.decoder import TransformerDecoder
from attnkit.transformer.decoder_layer import TransformerDecoderLayer
from attnkit.transformer.encoder import TransformerEncoder
from attnkit.transformer.encoder_layer import TransformerEncoderLayer

__all__ = [
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
