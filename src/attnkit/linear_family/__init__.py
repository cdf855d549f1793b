"""The gated linear-attention family: causal attention whose past is one state per head, of
size d_k × d_v whatever the length, with three forms that agree — parallel, chunkwise and
recurrent — and decoding from that state (:class:`RecurrentCache`).

- ``retention``: RetNet's multi-scale retention (Sun et al. 2023), a fixed decay per head;
- ``gla``: gated linear attention (Yang et al. 2023), data-dependent decays per key dimension;
- ``mamba2``: the Mamba-2 SSD layer (Dao and Gu 2024), a data-dependent scalar decay per head;
- ``deltanet`` and ``gated_deltanet``: the delta rule (Schlag et al. 2021; Yang et al. 2024),
  chunked with the WY representation, and its gated form (Yang et al. 2024);
- ``kda``: Kimi Delta Attention (Kimi Team 2025), the gated delta rule with a decay per key
  channel;
- ``lightning``: lightning attention (Qin et al. 2024; MiniMax 2025), a fixed decay per head
  without normalisation.

Each is a registered mechanism and an attention-slot part:
``ak.MultiHeadAttention(E, H, attention=ak.mechanisms.build("gla", head_dim=E // H,
num_heads=H))``.
"""

from attnkit.linear_family.base import (
    FORMS,
    Inputs,
    LinearFamilyPart,
    RecurrentCache,
    UnnormalizedWeights,
    recurrent_cache,
)
from attnkit.linear_family.deltanet import DeltaNet, GatedDeltaNet
from attnkit.linear_family.gla import GatedLinearAttention
from attnkit.linear_family.kda import KimiDeltaAttention
from attnkit.linear_family.lightning import LightningAttention
from attnkit.linear_family.mamba2 import Mamba2SSD
from attnkit.linear_family.retention import Retention

__all__ = [
    "FORMS",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "Inputs",
    "KimiDeltaAttention",
    "LightningAttention",
    "LinearFamilyPart",
    "Mamba2SSD",
    "RecurrentCache",
    "Retention",
    "UnnormalizedWeights",
    "recurrent_cache",
]
