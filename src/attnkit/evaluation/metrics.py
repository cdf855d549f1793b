"""Intrinsic measures of attention (Brauwers 4.2; Galassi V-VI)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import checks

__all__ = ["alignment_error_rate", "attention_correctness", "entropy", "rank_correlation"]


def _links(weights: Tensor, mode: str, threshold: float) -> Tensor:
    if mode == "argmax":
        return torch.zeros_like(weights, dtype=torch.bool).scatter_(
            -1, weights.argmax(-1, keepdim=True), True
        )
    if mode == "threshold":
        return weights >= threshold
    raise ValueError(f"mode must be 'argmax' or 'threshold', got {mode!r}")


def alignment_error_rate(
    weights: Tensor,
    sure: Tensor,
    possible: Tensor,
    *,
    mode: str = "argmax",
    threshold: float = 0.3,
    rows: Tensor | None = None,
) -> float:
    """AER = 1 − (|A∩S| + |A∩P|) / (|A| + |S|) over a whole corpus (Och & Ney; Brauwers 4.2).

    Args:
        weights: (…, T, N) attention of T outputs over N inputs.
        sure, possible: boolean (…, T, N) gold links, S ⊆ P (P is taken as P ∪ S).
        mode: predicted links A from the argmax of each row, or weights ≥ ``threshold``.
        rows: optional boolean (…, T): the output rows to score (e.g. not padding); rows with
            no sure and no possible link still count their predicted links.
    """
    weights = checks.floating(weights, "weights", "(…, T, N)", min_dim=2)
    if weights.shape != sure.shape or sure.shape != possible.shape:
        raise ValueError(
            f"weights {tuple(weights.shape)}, sure {tuple(sure.shape)} and possible "
            f"{tuple(possible.shape)} must have one shape"
        )
    links = "True = a gold link"
    s = checks.boolean_mask(sure, "sure", tuple(weights.shape), meaning=links)
    p = checks.boolean_mask(possible, "possible", tuple(weights.shape), meaning=links) | s
    a = _links(weights, mode, threshold)
    if rows is not None:
        rows = checks.boolean_mask(rows, "rows", tuple(weights.shape[:-1]), meaning="True = scored")
        keep = rows.unsqueeze(-1)
        a, s, p = a & keep, s & keep, p & keep
    denom = int(a.sum()) + int(s.sum())
    if denom == 0:
        raise ValueError("alignment_error_rate: no predicted and no sure links")
    return 1.0 - (int((a & s).sum()) + int((a & p).sum())) / denom


def attention_correctness(weights: Tensor, region: Tensor) -> float:
    """AC = Σ_{i ∈ G} a_i (Brauwers eq. 46): the attention mass inside the gold region,
    averaged over rows. weights (…, N); region boolean, broadcastable to the weights."""
    weights = checks.floating(weights, "weights", "(…, N)")
    region = checks.boolean_mask(
        region, "region", tuple(weights.shape), meaning="True = inside the gold region"
    )
    return float((weights * region.to(weights.dtype)).sum(-1).mean())


def _ranks(x: Tensor) -> Tensor:
    """Ranks along the last dim, ties sharing their mean rank."""
    order = x.argsort(-1)
    ranks = torch.empty_like(x)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=x.dtype).expand_as(x).contiguous())
    # Average ranks of ties.
    out = ranks.clone()
    for idx in torch.nonzero(torch.ones(x.shape[:-1], dtype=torch.bool)).tolist():
        row, r = x[tuple(idx)], ranks[tuple(idx)]
        for value in row.unique():
            tied = row == value
            if int(tied.sum()) > 1:
                out[tuple(idx)][tied] = r[tied].mean()
    return out


def _real(x: object, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (…, N), got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"{name} must be a real tensor (…, N), got dtype {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must be (…, N), got shape {tuple(x.shape)}")
    return x


def rank_correlation(weights: Tensor, reference: Tensor) -> float:
    """Spearman correlation between weights and a reference attention, per row (…, N),
    averaged over rows. Rows where either side is constant are skipped."""
    _real(weights, "weights")
    _real(reference, "reference")
    checks.same_shape(("weights", weights), ("reference", reference))
    a, b = _ranks(weights.double()), _ranks(reference.double())
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    denom = a.norm(dim=-1) * b.norm(dim=-1)
    ok = denom > 0
    if not bool(ok.any()):
        raise ValueError("rank_correlation: every row is constant")
    return float(((a * b).sum(-1)[ok] / denom[ok]).mean())


def entropy(weights: Tensor) -> float:
    """Mean entropy −Σ a log a of the rows (nats); 0 log 0 = 0. Negative weights are refused."""
    weights = checks.floating(weights, "weights", "(…, N)")
    checks.nonnegative(weights, "weights")
    w = weights.double()
    value = -(torch.where(w > 0, w * w.log(), torch.zeros_like(w))).sum(-1).mean()
    return max(0.0, float(value))  # no "-0.0" for one-hot rows
