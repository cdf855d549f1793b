"""Packed variable-length batches: several sequences laid end to end in one row of T tokens,
described by their cumulative lengths ``cu_seqlens`` = [0, n₁, n₁ + n₂, …, T] (as FlashAttention's
varlen interface), with a document mask so that no token attends across a boundary:

    doc(i) = the s with cu_seqlens[s] ≤ i < cu_seqlens[s + 1]
    allowed(i, j) = doc(i) = doc(j)  (and j ≤ i when causal)

Each packed sequence then gets exactly the result it gets alone. Positions restart at 0 in
every sequence (:func:`position_ids`), which is what a position scheme must read for the packed
run to equal the separate ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.kernels.block_mask import DEFAULT_BLOCK, BlockMask
from attnkit.patterns.base import MaskMod

__all__ = ["document_ids", "packed", "packed_block_mask", "packed_mask", "position_ids"]


def _check(cu_seqlens: object) -> Tensor:
    if (
        not isinstance(cu_seqlens, Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.is_floating_point()
        or cu_seqlens.dtype == torch.bool
    ):
        got = (
            f"shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
            if isinstance(cu_seqlens, Tensor)
            else type(cu_seqlens).__name__
        )
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor [0, n1, n1 + n2, ...], got {got}")
    if cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0:
        raise ValueError(
            f"cu_seqlens must start at 0 and hold at least one sequence, got {cu_seqlens.tolist()}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must not decrease, got {cu_seqlens.tolist()}")
    return cu_seqlens.long()


def document_ids(cu_seqlens: Tensor) -> Tensor:
    """(T,) int64: the sequence each packed token belongs to, T = cu_seqlens[-1]."""
    cu = _check(cu_seqlens)
    total = int(cu[-1])
    return torch.searchsorted(cu[1:], torch.arange(total, device=cu.device), right=True)


def position_ids(cu_seqlens: Tensor) -> Tensor:
    """(T,) int64: each token's position within its own sequence."""
    cu = _check(cu_seqlens)
    doc = document_ids(cu)
    return torch.arange(int(cu[-1]), device=cu.device) - cu[doc]


def packed(cu_seqlens: Tensor, *, causal: bool = False) -> MaskMod:
    """The document pattern of a packed row as a ``mask_mod`` (queries and keys are the same
    T tokens); with ``causal`` only earlier tokens of the same sequence."""
    doc = document_ids(cu_seqlens)
    causal = arguments.boolean(causal, "causal")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = doc[q_idx] == doc[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return mask_mod


def packed_mask(cu_seqlens: Tensor, *, causal: bool = False) -> Tensor:
    """The (T, T) boolean document mask (True = may attend)."""
    doc = document_ids(cu_seqlens)
    same = doc[:, None] == doc[None, :]
    causal = arguments.boolean(causal, "causal")
    return same.tril() if causal else same


def packed_block_mask(
    cu_seqlens: Tensor,
    *,
    causal: bool = False,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
) -> BlockMask:
    """The block mask of :func:`packed`: tiles across sequence boundaries are skipped, so the
    cost follows Σ nᵢ² rather than T²."""
    total = int(_check(cu_seqlens)[-1])
    return BlockMask.from_mask_mod(
        packed(cu_seqlens, causal=causal), total, total, block_q=block_q, block_k=block_k,
        device=cu_seqlens.device,
    )  # fmt: skip
