"""Lightning attention (Qin et al. 2024, "Lightning Attention-2: A Free Lunch for Handling
Unlimited Sequence Lengths in Large Language Models"; MiniMax 2025, "MiniMax-01: Scaling
Foundation Models with Lightning Attention"): causal linear attention without a feature map or
normalisation whose state decays by a fixed factor λ_h per head.

Per head (Lightning Attention-2 eqs. 4-8, the form of MiniMax-01's layer):

    S_t = λ S_{t−1} + k_t v_tᵀ,   o_t = S_tᵀ q_t,

equivalently o = [(Q Kᵀ) ⊙ M] V with M_ts = λ^(t−s) for t ≥ s and 0 otherwise. Neither q nor the
scores are scaled or normalised (the layer normalises its output instead). Lightning
Attention-2 tiles the sequence into blocks: the intra-block part by the quadratic form
[(Q_i K_iᵀ) ⊙ M] V_i, the inter-block part from the state before the block,
(Q_i ⊙ λ^(1…B)) S, and S ← λ^B S + (K_i ⊙ λ^(B−1…0))ᵀ V_i. That is the chunkwise form of
:mod:`attnkit.linear_family.decay` with a block as a chunk, which this part runs (the block
size does not change the result, only the cost; the recurrent form decodes).

The decays are MiniMax's: λ_h = exp(−s_h) with the ALiBi slopes s_h = 2^(−8(h+1)/H) (Press et
al. 2022, for h = 0 … H − 1; MiniMax uses this formula for every H, not ALiBi's interpolation
when H is not a power of two), scaled per layer by 1 − l/(L − 1 + 10⁻⁵) + 10⁻⁵ for layer l of L,
so that deeper layers forget more slowly (the last layer's decay is ≈ 1).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.derived import DerivedBuffers
from attnkit.head_registry import REGISTRY
from attnkit.linear_family.base import Inputs, _DecayFamily

__all__ = ["LightningAttention", "lightning_slopes"]


def lightning_slopes(num_heads: int, layer_idx: int = 0, num_layers: int = 1) -> Tensor:
    """MiniMax's decay rates s_h (H,), float64: λ_h = exp(−s_h) with
    s_h = 2^(−8(h+1)/H) · (1 − l/(L − 1 + 10⁻⁵) + 10⁻⁵) for layer l of L.

    Raises ValueError when ``layer_idx`` is not one of the ``num_layers`` layers."""
    num_heads = arguments.positive_int(num_heads, "num_heads")
    num_layers = arguments.positive_int(num_layers, "num_layers")
    layer_idx = arguments.nonnegative_int(layer_idx, "layer_idx")
    if layer_idx >= num_layers:
        raise ValueError(
            f"layer_idx must be one of the num_layers = {num_layers} layers (0 … "
            f"{num_layers - 1}), got {layer_idx}"
        )
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** torch.arange(1, num_heads + 1, dtype=torch.float64)
    return rate * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


@REGISTRY.register("lightning")
class LightningAttention(DerivedBuffers, _DecayFamily):
    """Lightning attention as a per-head part (see :class:`LinearFamilyPart` for the call and
    the module docstring for the rule).

    Args:
        head_dim: d (q is not scaled).
        num_heads: H; head h decays by λ_h = exp(−s_h) (:func:`lightning_slopes`).
        layer_idx, num_layers: the layer's place in its stack, which scales the slopes
            (MiniMax-01); one layer by default.
        form, chunk_size: as :class:`LinearFamilyPart`; a chunk is Lightning Attention-2's
            block.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        layer_idx: int = 0,
        num_layers: int = 1,
        form: str = "chunkwise",
        chunk_size: int = 64,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(head_dim, num_heads, form=form, chunk_size=chunk_size)
        slopes = lightning_slopes(num_heads, layer_idx, num_layers)
        self.layer_idx, self.num_layers = layer_idx, num_layers
        kw = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.register_derived("log_decay", -slopes.view(num_heads, 1, 1), **kw)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer_idx={self.layer_idx}, num_layers={self.num_layers}"

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.MULTIPLICATIVE, tx.AlignmentKind.SOFT]

    def prepare(self, q: Tensor, k: Tensor, v: Tensor) -> Inputs:
        g = self.log_decay.to(q.dtype) + torch.zeros_like(k[..., :1])
        return Inputs(q, k, v, g)
