"""Local patterns: causal, sliding window, dilated sliding window (Soydaner 5.1; Longformer's
windows; Wikipedia "FlexAttention")."""

from __future__ import annotations

from torch import Tensor

from attnkit import arguments
from attnkit.patterns.base import MaskMod

__all__ = ["causal", "dilated_window", "sliding_window"]


def causal() -> MaskMod:
    """Query i attends keys j ≤ i (autoregressive)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    return mask_mod


def sliding_window(size: int, *, causal: bool = False) -> MaskMod:
    """Query i attends keys j with |i − j| ≤ size (only j ≤ i when ``causal``)."""
    size = arguments.nonnegative_int(size, "size")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        near = (q_idx - kv_idx).abs() <= size
        return near & (kv_idx <= q_idx) if causal else near

    return mask_mod


def dilated_window(size: int, dilation: int, *, causal: bool = False) -> MaskMod:
    """Longformer's dilated window: keys j = i ± t·dilation for t = 0 … size."""
    size = arguments.nonnegative_int(size, "size")
    dilation = arguments.positive_int(dilation, "dilation")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        gap = q_idx - kv_idx
        out = (gap.abs() <= size * dilation) & (gap % dilation == 0)
        return out & (gap >= 0) if causal else out

    return mask_mod
