"""The sliding window of a Transformer layer's self-attention (``window=``, a plan's
``sliding:W``: Gemma 2/3's and Mistral's local layers): causally each query attends itself and
the W − 1 places before it, else the places less than W away.

Two forms of one window: a dense (M, N) mask for the rows of a decoding step
(:func:`window_mask`), and for a whole sequence a :class:`attnkit.kernels.BlockMask` built from
the band's geometry (:func:`window_block_mask`), so that neither building it nor attending
under it costs N²: the chunked kernel visits the tiles the band reaches, about N·(W + block)
scores."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from attnkit import patterns
from attnkit.kernels.block_mask import DEFAULT_BLOCK, BlockMask, MaskMod

__all__ = ["window_block_mask", "window_mask", "window_pattern"]


@functools.cache
def window_pattern(window: int, causal: bool) -> MaskMod:
    """The window as a mask function (:func:`attnkit.patterns.sliding_window`), one per
    (window, causal)."""
    return patterns.sliding_window(window - 1, causal=causal)


def window_mask(window: int, m: int, n: int, causal: bool, device: torch.device) -> Tensor:
    """(M, N) True where a query may attend a key: the M queries are the last of N places."""
    i = torch.arange(n - m, n, device=device)[:, None]
    d = i - torch.arange(n, device=device)[None, :]
    return (d < window) & (d >= 0) if causal else d.abs() < window


@functools.lru_cache(maxsize=16)
def window_block_mask(
    window: int, n: int, causal: bool, device: torch.device, block: int = DEFAULT_BLOCK
) -> BlockMask:
    """The window over N queries × N keys as a block mask of ``block`` × ``block`` tiles, equal
    to ``BlockMask.from_mask_mod(window_pattern(window, causal), n, n)`` but built in O(N·W):
    a tile's query − key distances form one interval [d_min, d_max], so whether the band
    reaches it (any pair allowed) or covers it (every pair) is read from the interval's ends,
    and only the tiles it cuts are evaluated pair by pair (about two per row of tiles). Kept
    for the 16 most recent (window, N, causal, device, block)."""
    starts = torch.arange(0, n, block)
    ends = (starts + block).clamp(max=n) - 1  # the last place of each tile
    d_min = starts[:, None] - ends[None, :]  # query tile i, key tile j
    d_max = ends[:, None] - starts[None, :]
    low = 0 if causal else -(window - 1)
    any_allowed = (d_max >= low) & (d_min <= window - 1)
    all_allowed = (d_min >= low) & (d_max <= window - 1)
    pattern = window_pattern(window, causal)
    zero = torch.zeros((), dtype=torch.long, device=device)
    partial = {}
    for i, j in (any_allowed & ~all_allowed).nonzero().tolist():
        q_idx = torch.arange(starts[i], ends[i] + 1, device=device)[:, None]
        kv_idx = torch.arange(starts[j], ends[j] + 1, device=device)[None, :]
        partial[i, j] = pattern(zero, zero, q_idx, kv_idx)
    # every query attends at least itself
    has_key = torch.ones(n, 1, dtype=torch.bool, device=device)
    return BlockMask(
        (), n, n, block, block, any_allowed, all_allowed, has_key, mask_mod=pattern, partial=partial
    )
