"""Effective attention (Brunner et al. 2020, "On identifiability in transformers", Sec. 4):
the part of each attention row that reaches the output.

A head's output is A T, with A (M, N) the weights and T (N, d_v) the values. When N > d_v, T has a
left null space LN(T) = {x : xᵀ T = 0}, and any component of a row of A in it changes nothing.
Effective attention removes it: Ã = A − Proj_LN(T)(A) = A U Uᵀ, U an orthonormal basis of the
column space of T. Then Ã T = A T exactly; Ã need not be non-negative nor sum to 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["effective_attention"]


def effective_attention(weights: Tensor, values: Tensor, *, rtol: float | None = None) -> Tensor:
    """Ã = A − Proj_LN(T)(A) (Brunner et al. 2020, eq. 6).

    Args:
        weights: A (…, M, N).
        values: T (…, N, d_v), the values the weights average (per head, before W^O).
        rtol: singular values below ``rtol`` × the largest count as zero (the rank of T);
            default: the dtype's eps × max(N, d_v).

    Returns: Ã (…, M, N), in the weights' dtype (computed in at least float32).
    """
    if not isinstance(weights, Tensor) or not isinstance(values, Tensor):
        raise TypeError("weights and values must be Tensors")
    if weights.dim() < 2 or values.dim() < 2 or weights.shape[-1] != values.shape[-2]:
        raise ValueError(
            f"weights (…, M, N) {tuple(weights.shape)} and values (…, N, d_v) "
            f"{tuple(values.shape)} must share N"
        )
    dtype = torch.promote_types(weights.dtype, torch.float32)
    t = values.to(dtype)
    u, s, _ = torch.linalg.svd(t, full_matrices=False)  # u (…, N, r)
    n, d = t.shape[-2:]
    tol = rtol if rtol is not None else torch.finfo(dtype).eps * max(n, d)
    rank = s > tol * s.amax(-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    u = u * rank.unsqueeze(-2).to(dtype)  # drop directions T does not span
    a = weights.to(dtype)
    return ((a @ u) @ u.transpose(-2, -1)).to(weights.dtype)
