"""Spatial attention for feature maps and CBAM (Woo et al. 2018, "CBAM: Convolutional Block
Attention Module"; Wikipedia "Variants": CNN attention).

Spatial attention pools the channels of F (B, C, H, W) at every position — mean and max — and a
k × k convolution of the two maps scores each position, M_s = σ(f^{k×k}([AvgPool(F); MaxPool(F)]))
(CBAM eq. 3); the output is M_s ⊙ F. CBAM applies channel attention, then spatial attention:
F' = M_c(F) ⊙ F, F'' = M_s(F') ⊙ F' (CBAM eq. 1).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, hooks
from attnkit import taxonomy as tx
from attnkit.alignments import Sigmoid
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.vision.channel import ChannelAttention, feature_map

__all__ = ["CBAM", "CBAMOutput", "SpatialAttention", "SpatialAttentionOutput"]


class SpatialAttentionOutput(NamedTuple):
    """The reweighted map M_s ⊙ F (B, C, H, W) and the weights M_s (B, H, W)."""

    output: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("spatial_attention")
class SpatialAttention(nn.Module):
    """CBAM's spatial attention (Woo et al. eq. 3).

    Args:
        kernel_size: k, odd (7 in the paper); the convolution keeps the map's size.
        align: turns the scores into weights (default sigmoid).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        kernel_size: int = 7,
        *,
        align: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(kernel_size, "kernel_size")
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd (to keep the map's size), got {kernel_size}")
        self.conv = nn.Conv2d(
            2, 1, kernel_size, padding=kernel_size // 2, device=device, dtype=dtype
        )
        self.align = (
            Sigmoid()
            if align is None
            else checks.resolve_alignment(align, device=device, dtype=dtype)
        )

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(k = 3; x (2, 3, 4, 4))."""
        return cls(3), (example_tensor(2, 3, 4, 4),), {}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.CONVOLUTIONAL, tx.QueryType.SELF_ATTENTIVE]

    def forward(self, x: Tensor) -> SpatialAttentionOutput:
        """x (B, C, H, W) → M_s ⊙ x, M_s (B, H, W)."""
        x = feature_map(x, "x")
        pooled = torch.stack([x.mean(1), x.amax(1)], 1)  # (B, 2, H, W)
        scores = self.conv(pooled)[:, 0]  # (B, H, W)
        w = self.align(scores.flatten(1).unsqueeze(-2)).weights.reshape(scores.shape)
        hooks.report(self, w)
        return SpatialAttentionOutput(x * w.unsqueeze(1), w)


class CBAMOutput(NamedTuple):
    """F'' (B, C, H, W), the channel weights (B, C) and the spatial weights (B, H, W)."""

    output: Tensor
    channel_weights: Tensor
    spatial_weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"channel": self.channel_weights, "spatial": self.spatial_weights}


@REGISTRY.register("cbam")
class CBAM(nn.Module):
    """Channel attention (average and max pooled, CBAM eq. 2) then spatial attention (eq. 3).

    Args:
        channels: C; reduction: r of the channel network; kernel_size: k of the spatial one.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        channels: int,
        reduction: int = 16,
        kernel_size: int = 7,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.channel = ChannelAttention(channels, reduction, pools=("avg", "max"), **kw)
        self.spatial = SpatialAttention(kernel_size, **kw)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(C = 4, r = 2, k = 3; x (2, 4, 3, 3))."""
        return cls(4, 2, 3), (example_tensor(2, 4, 3, 3),), {}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(self, x: Tensor) -> CBAMOutput:
        """x (B, C, H, W) → F'' and both weights."""
        c = self.channel(x)
        s = self.spatial(c.output)
        return CBAMOutput(s.output, c.weights, s.weights)
