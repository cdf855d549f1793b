"""Gathered evaluation shared by the efficient parts that attend within index sets (a band of
keys per query block, the members of a cluster): pick the (query, key) pairs of a mask or bias
without broadcasting it to (…, M, N) first.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pairs"]


def pairs(t: Tensor, rows: Tensor, cols: Tensor, lead: int) -> Tensor:
    """``t[..., rows, cols]`` for a tensor ``t`` broadcastable to (*L, M, N) with ``lead`` = len(L)
    leading dims.

    Args:
        t: (…, M or 1, N or 1), broadcastable to (*L, M, N).
        rows, cols: integer tensors (*L or 1s, *S) that broadcast with each other: the query and
            key index of every pair; their first ``lead`` dims follow L (or are 1).
        lead: the number of leading dims L.

    Returns:
        (*L', *S): the entries of ``t`` at the pairs, L' the broadcast of t's and the indices'
        leading dims. Only the result is materialised (a size-1 dim of ``t`` is indexed at 0).
    """
    t = t.reshape((1,) * (lead + 2 - t.dim()) + tuple(t.shape))
    extra = max(rows.dim(), cols.dim()) - lead
    index = []
    for i, size in enumerate(t.shape[:lead]):
        shape = [1] * (lead + extra)
        if size != 1:
            shape[i] = size
        index.append(torch.arange(size, device=t.device).reshape(shape))
    r = rows if t.shape[-2] > 1 else torch.zeros_like(rows)
    c = cols if t.shape[-1] > 1 else torch.zeros_like(cols)
    return t[(*index, r, c)]
