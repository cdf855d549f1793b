"""Image patterns (Image Transformer, Parmar et al.; Soydaner 5.1): a 2-D neighbourhood over a
row-major H × W grid, and 1-D query blocks that attend their own memory block."""

from __future__ import annotations

from torch import Tensor

from attnkit import arguments
from attnkit.patterns.base import MaskMod

__all__ = ["local_2d", "query_blocks"]


def local_2d(width: int, radius: int) -> MaskMod:
    """Positions p are pixels of a row-major grid ``width`` wide; query pixel (r, c) attends
    key pixels (r', c') with |r − r'| ≤ radius and |c − c'| ≤ radius."""
    width = arguments.positive_int(width, "width")
    radius = arguments.nonnegative_int(radius, "radius")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        rows = (q_idx // width - kv_idx // width).abs() <= radius
        cols = (q_idx % width - kv_idx % width).abs() <= radius
        return rows & cols

    return mask_mod


def query_blocks(block: int, memory: int = 0, *, causal: bool = False) -> MaskMod:
    """Queries in blocks of ``block`` positions; a block attends its own positions and the
    ``memory`` positions before it (Image Transformer's 1-D local attention)."""
    block = arguments.positive_int(block, "block")
    memory = arguments.nonnegative_int(memory, "memory")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        start = (q_idx // block) * block
        out = (kv_idx >= start - memory) & (kv_idx < start + block)
        return out & (kv_idx <= q_idx) if causal else out

    return mask_mod
