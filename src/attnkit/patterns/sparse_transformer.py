"""The factorised patterns of the Sparse Transformer (Child et al. 2019; Soydaner 5.1): each
query attends a local part and a strided (or fixed-summary) part, here as one union pattern."""

from __future__ import annotations

from torch import Tensor

from attnkit import arguments
from attnkit.patterns.base import MaskMod

__all__ = ["fixed", "strided"]


def strided(stride: int, *, causal: bool = True) -> MaskMod:
    """Strided attention: key j is allowed for query i when i − j < stride (the previous
    ``stride`` positions) or (i − j) mod stride = 0; with ``causal``, only j ≤ i."""
    stride = arguments.positive_int(stride, "stride")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        gap = q_idx - kv_idx
        local = gap.abs() < stride
        out = local | (gap % stride == 0)
        return out & (gap >= 0) if causal else out

    return mask_mod


def fixed(stride: int, summary: int = 1, *, causal: bool = True) -> MaskMod:
    """Fixed attention: key j is allowed for query i when both lie in the same block of
    ``stride`` positions (⌊j/stride⌋ = ⌊i/stride⌋) or j is one of the last ``summary``
    positions of its block (j mod stride ≥ stride − summary); with ``causal``, only j ≤ i."""
    stride = arguments.positive_int(stride, "stride")
    summary = arguments.positive_int(summary, "summary")
    if summary > stride:
        raise ValueError(f"summary = {summary} must be at most stride = {stride}")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (q_idx // stride) == (kv_idx // stride)
        out = same | (kv_idx % stride >= stride - summary)
        return out & (kv_idx <= q_idx) if causal else out

    return mask_mod
