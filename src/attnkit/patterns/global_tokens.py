"""Global-token patterns: Longformer (a window plus global tokens that attend and are attended
everywhere) and BigBird (window + global tokens + random key blocks) (Soydaner 5.1)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.patterns.base import MaskMod

__all__ = ["bigbird", "longformer"]


def _global_positions(positions: Sequence[int]) -> Tensor:
    if isinstance(positions, Tensor):
        positions = positions.tolist()
    out = [arguments.nonnegative_int(p, "global position") for p in positions]
    return torch.tensor(sorted(set(out)), dtype=torch.long)


def _is_global(idx: Tensor, positions: Tensor) -> Tensor:
    if positions.numel() == 0:
        return torch.zeros_like(idx, dtype=torch.bool)
    return torch.isin(idx, positions.to(idx.device))


def longformer(window: int, global_positions: Sequence[int] = (0,)) -> MaskMod:
    """|i − j| ≤ window, or i or j is a global position (Beltagy et al.)."""
    window = arguments.nonnegative_int(window, "window")
    positions = _global_positions(global_positions)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        local = (q_idx - kv_idx).abs() <= window
        return local | _is_global(q_idx, positions) | _is_global(kv_idx, positions)

    return mask_mod


def bigbird(
    window: int,
    n: int,
    *,
    global_positions: Sequence[int] = (0,),
    random_blocks: int = 1,
    block: int = 64,
    seed: int = 0,
) -> MaskMod:
    """BigBird (Zaheer et al.): a sliding window, global tokens, and for each query block of
    ``block`` rows, ``random_blocks`` of the ⌈n/block⌉ key blocks chosen at random (fixed by
    ``seed``, the same for every batch entry and head); ``n`` is the key length."""
    window = arguments.nonnegative_int(window, "window")
    n = arguments.positive_int(n, "n")
    random_blocks = arguments.nonnegative_int(random_blocks, "random_blocks")
    block = arguments.positive_int(block, "block")
    positions = _global_positions(global_positions)
    n_blocks = -(-n // block)
    gen = torch.Generator().manual_seed(arguments.nonnegative_int(seed, "seed"))
    # For query block qb, key block (qb·a + c_r) mod n_blocks for rank r: random offsets c_r and
    # a random odd multiplier a give every query block its own blocks, defined for any number
    # of query blocks without a table.
    offsets = torch.randint(n_blocks, (random_blocks,), generator=gen)
    mult = int(torch.randint(n_blocks, (1,), generator=gen)) * 2 + 1

    def chosen(q_block: Tensor, k_block: Tensor) -> Tensor:
        out = torch.zeros(torch.broadcast_shapes(q_block.shape, k_block.shape), dtype=torch.bool)
        for c in offsets.tolist():
            out = out | ((q_block * mult + c) % n_blocks == k_block)
        return out

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        local = (q_idx - kv_idx).abs() <= window
        glob = _is_global(q_idx, positions) | _is_global(kv_idx, positions)
        return local | glob | chosen(q_idx // block, kv_idx // block)

    return mask_mod
