"""How far two importance rankings over the same items agree: Kendall τ (Jain & Wallace 2019,
Sec. 3 compare attention with gradient and leave-one-out importance by it) and top-k overlap."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["kendall_tau", "mean_defined", "top_k_overlap"]


def _pair(a: Tensor, b: Tensor, keep: Tensor | None, name: str) -> Tensor:
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError(f"{name}: a and b must be Tensors")
    if a.shape != b.shape or a.dim() < 1:
        raise ValueError(
            f"{name}: a {tuple(a.shape)} and b {tuple(b.shape)} must have one shape (…, N)"
        )
    if keep is None:
        return torch.ones(a.shape, dtype=torch.bool, device=a.device)
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
        raise TypeError(
            f"{name}: keep must be a boolean tensor (True = an item that counts), got {got}; "
            "convert a 0/1 tensor with keep.bool()"
        )
    if keep.shape != a.shape:
        raise ValueError(
            f"{name}: keep must have the shape of a {tuple(a.shape)}, got {tuple(keep.shape)}"
        )
    return keep


def kendall_tau(a: Tensor, b: Tensor, keep: Tensor | None = None) -> Tensor:
    """Kendall's τ-b between the rows of ``a`` and ``b`` (…, N), over the items ``keep``
    marks: (concordant − discordant pairs) / √((n₀ − n₁)(n₀ − n₂)), n₀ the number of pairs and
    n₁, n₂ those tied in a and in b. Returns (…,), NaN for a row with fewer than two items or
    constant on either side (undefined); see :func:`mean_defined`."""
    keep = _pair(a, b, keep, "kendall_tau")
    a, b = a.double(), b.double()
    sa = torch.sign(a.unsqueeze(-1) - a.unsqueeze(-2))
    sb = torch.sign(b.unsqueeze(-1) - b.unsqueeze(-2))
    n = a.shape[-1]
    upper = torch.ones(n, n, dtype=torch.bool, device=a.device).triu(1)
    pairs = upper & keep.unsqueeze(-1) & keep.unsqueeze(-2)
    p = pairs.double()
    n0 = p.sum((-2, -1))
    untied_a = ((sa != 0).double() * p).sum((-2, -1))  # n₀ − n₁
    untied_b = ((sb != 0).double() * p).sum((-2, -1))  # n₀ − n₂
    s = (sa * sb * p).sum((-2, -1))
    denom = (untied_a * untied_b).sqrt()
    nan = torch.full_like(s, math.nan)
    return torch.where((denom > 0) & (n0 > 0), s / denom.clamp_min(1e-300), nan)


def top_k_overlap(a: Tensor, b: Tensor, k: int, keep: Tensor | None = None) -> Tensor:
    """|top-k(a) ∩ top-k(b)| / k per row (…, N), over the items ``keep`` marks (rows with fewer
    than k kept items use all of them and divide by their count). Ties are broken by position.
    ``k`` must lie in [1, N]. Returns (…,) in [0, 1]."""
    keep = _pair(a, b, keep, "top_k_overlap")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int ≥ 1, got {k!r}")
    if k > a.shape[-1]:
        raise ValueError(
            f"k must be at most N = {a.shape[-1]}, the items per row of a {tuple(a.shape)}, "
            f"got k = {k} (the top k of N < k items would always overlap fully)"
        )
    low = torch.tensor(-math.inf, dtype=torch.float64, device=a.device)
    ia = torch.where(keep, a.double(), low).topk(k, dim=-1).indices
    ib = torch.where(keep, b.double(), low).topk(k, dim=-1).indices
    chosen_a = torch.zeros(a.shape, dtype=torch.bool, device=a.device).scatter_(-1, ia, True)
    chosen_b = torch.zeros(a.shape, dtype=torch.bool, device=a.device).scatter_(-1, ib, True)
    both = (chosen_a & chosen_b & keep).sum(-1).double()
    return both / keep.sum(-1).clamp(max=k).clamp_min(1).double()


def mean_defined(values: Tensor) -> float:
    """Mean over the defined (non-NaN) entries; NaN when none is defined."""
    ok = ~torch.isnan(values)
    return float(values[ok].mean()) if bool(ok.any()) else math.nan
