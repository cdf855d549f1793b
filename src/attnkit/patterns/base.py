"""Mask functions: a sparse attention pattern as ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

The index arguments are integer tensors that broadcast against each other (as in PyTorch's
FlexAttention): ``b`` and ``h`` index the batch and the head, ``q_idx`` the query position,
``kv_idx`` the key position. A pattern returns True where the query may attend the key. Turn one
into a block mask with :meth:`attnkit.kernels.BlockMask.from_mask_mod` (or
:func:`attnkit.patterns.block_mask`) and pass it to ``ak.attention(..., block_mask=...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.kernels.block_mask import DEFAULT_BLOCK, BlockMask, MaskMod

__all__ = ["MaskMod", "and_masks", "block_mask", "dense", "or_masks"]


def _check(mods: tuple[Callable, ...], what: str) -> None:
    if not mods:
        raise ValueError(f"{what} needs at least one mask function")
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"{what}: argument {i} is not a mask function ({type(mod).__name__})")


def and_masks(*mods: MaskMod) -> MaskMod:
    """A key is allowed where every pattern allows it."""
    _check(mods, "and_masks")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out & mod(b, h, q_idx, kv_idx)
        return out

    return mask_mod


def or_masks(*mods: MaskMod) -> MaskMod:
    """A key is allowed where any pattern allows it."""
    _check(mods, "or_masks")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            out = out | mod(b, h, q_idx, kv_idx)
        return out

    return mask_mod


def dense(mask_mod: MaskMod, m: int, n: int) -> Tensor:
    """The (M, N) boolean mask of a pattern that does not depend on batch or head."""
    q_idx = torch.arange(m)[:, None]
    kv_idx = torch.arange(n)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, q_idx, kv_idx).expand(m, n)


@arguments.renamed(heads="num_heads")
def block_mask(
    mask_mod: MaskMod,
    m: int,
    n: int | None = None,
    *,
    batch: int | None = None,
    num_heads: int | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
) -> BlockMask:
    """The block mask of a pattern over M queries × N keys (N = M by default).

    Args:
        mask_mod: the pattern, ``mask_mod(b, h, q_idx, kv_idx)`` -> bool (True = may attend).
        m: M, the queries. n: N, the keys (M when None).
        batch: B when the pattern depends on the batch index (None: it does not).
        num_heads: H when the pattern depends on the head index (None: it does not).
        block_q: queries per block. block_k: keys per block.
    """
    arguments.optional_positive_int(num_heads, "num_heads")
    return BlockMask.from_mask_mod(
        mask_mod,
        m,
        m if n is None else n,
        batch=batch,
        num_heads=num_heads,
        block_q=block_q,
        block_k=block_k,
    )
