"""The efficient-attention family (Soydaner 5; Brauwers 3.1), one file per mechanism: each is a
registered mechanism and a per-head part for ``MultiHeadAttention(attention=...)``."""

from attnkit.efficient.adaptive_span import AdaptiveSpanAttention, DynamicSpanAttention
from attnkit.efficient.adaptive_sparse import AdaptivelySparseAttention
from attnkit.efficient.area import AreaAttention
from attnkit.efficient.biblosa import BiBloSA, BiBloSAOutput
from attnkit.efficient.fast_weights import FastWeightProgrammer
from attnkit.efficient.fmm import FMMformer
from attnkit.efficient.linear import LinearAttention
from attnkit.efficient.linformer import Linformer
from attnkit.efficient.lite import LongShortRangeAttention, LongShortRangeOutput
from attnkit.efficient.lsh import LSHAttention
from attnkit.efficient.luna import LunaAttention, LunaOutput
from attnkit.efficient.nystrom import NystromAttention
from attnkit.efficient.perceiver import PerceiverEncoder, PerceiverOutput
from attnkit.efficient.performer import Performer
from attnkit.efficient.resa import ReinforcedSelfAttention, ReSAOutput
from attnkit.efficient.reversible import ReversibleOutput, ReversibleStack
from attnkit.efficient.rfa import RandomFeatureAttention
from attnkit.efficient.routing import RoutingAttention
from attnkit.efficient.rpe_fft import RelativeKernelAttention
from attnkit.efficient.set_transformer import ISAB, MAB, PMA, SAB, ISABOutput, SetOutput
from attnkit.efficient.sinkhorn import SinkhornAttention
from attnkit.efficient.skyformer import Skyformer
from attnkit.efficient.soft import SoftmaxFreeAttention
from attnkit.efficient.synthesizer import Synthesizer
from attnkit.efficient.tensorized import MultiLinearAttention
from attnkit.output import HeadOutput

__all__ = [
    "ISAB",
    "MAB",
    "PMA",
    "SAB",
    "AdaptiveSpanAttention",
    "AdaptivelySparseAttention",
    "AreaAttention",
    "BiBloSA",
    "BiBloSAOutput",
    "DynamicSpanAttention",
    "FMMformer",
    "FastWeightProgrammer",
    "HeadOutput",
    "ISABOutput",
    "LSHAttention",
    "LinearAttention",
    "Linformer",
    "LongShortRangeAttention",
    "LongShortRangeOutput",
    "LunaAttention",
    "LunaOutput",
    "MultiLinearAttention",
    "NystromAttention",
    "PerceiverEncoder",
    "PerceiverOutput",
    "Performer",
    "RandomFeatureAttention",
    "ReSAOutput",
    "ReinforcedSelfAttention",
    "RelativeKernelAttention",
    "ReversibleOutput",
    "ReversibleStack",
    "RoutingAttention",
    "SetOutput",
    "SinkhornAttention",
    "Skyformer",
    "SoftmaxFreeAttention",
    "Synthesizer",
]
