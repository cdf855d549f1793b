"""Token-mixer layers of today's models, built from attnkit parts: the layers that sit where
self-attention sits in a hybrid stack (see :mod:`attnkit.mixers.base` for the contract).

Each is registered in :data:`REGISTRY` and built by name:
``attnkit.mixers.REGISTRY.build("mamba2", embed_dim=64, ...)``.
"""

from attnkit.mixers.base import REGISTRY, MixerCache, TokenMixer
from attnkit.mixers.conv import ShortConv
from attnkit.mixers.gated_deltanet import GatedDeltaNetMixer
from attnkit.mixers.gated_norm import GatedRMSNorm
from attnkit.mixers.kda import KimiDeltaAttentionMixer
from attnkit.mixers.lightning import LightningAttentionMixer
from attnkit.mixers.mamba2 import Mamba2Mixer

__all__ = [
    "REGISTRY",
    "GatedDeltaNetMixer",
    "GatedRMSNorm",
    "KimiDeltaAttentionMixer",
    "LightningAttentionMixer",
    "Mamba2Mixer",
    "MixerCache",
    "ShortConv",
    "TokenMixer",
]
