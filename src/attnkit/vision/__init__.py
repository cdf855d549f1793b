"""Attention for images and feature maps (Wikipedia "Variants": CNN attention; Soydaner Sec. 5;
Brauwers on Oktay et al.): channel attention (squeeze-and-excitation, CBAM), spatial attention,
CBAM, SAGAN self-attention, attention gates, and recurrent glimpses."""

from attnkit.vision.channel import ChannelAttention, ChannelAttentionOutput
from attnkit.vision.draw import DRAWFilterbank, DRAWRead, DRAWReadOutput
from attnkit.vision.gates import AttentionGate, AttentionGateOutput
from attnkit.vision.glimpses import GlimpseOutput, RecurrentAttention, glimpse_sensor
from attnkit.vision.sagan import SAGANSelfAttention, SAGANSelfAttentionOutput
from attnkit.vision.spatial import CBAM, CBAMOutput, SpatialAttention, SpatialAttentionOutput
from attnkit.vision.xcit import CrossCovarianceAttention, CrossCovarianceAttentionOutput

__all__ = [
    "CBAM",
    "AttentionGate",
    "AttentionGateOutput",
    "CBAMOutput",
    "ChannelAttention",
    "ChannelAttentionOutput",
    "CrossCovarianceAttention",
    "CrossCovarianceAttentionOutput",
    "DRAWFilterbank",
    "DRAWRead",
    "DRAWReadOutput",
    "GlimpseOutput",
    "RecurrentAttention",
    "SAGANSelfAttention",
    "SAGANSelfAttentionOutput",
    "SpatialAttention",
    "SpatialAttentionOutput",
    "glimpse_sensor",
]
