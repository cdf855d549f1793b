"""Attention sharpness as a confidence signal: does a peaked distribution (high maximum weight,
low entropy) go with a correct prediction? (Galassi VI on attention as a proxy for model
confidence.)"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attention_confidence", "confidence_correlation"]


def attention_confidence(weights: Tensor) -> dict[str, Tensor]:
    """Per row of ``weights`` (…, N): ``max_weight`` max_l a_l and ``neg_entropy``
    Σ_l a_l log a_l (≤ 0; higher = sharper). Returns name -> (…,)."""
    if not isinstance(weights, Tensor) or weights.dim() < 1:
        raise TypeError("weights must be a Tensor (…, N)")
    w = weights.double()
    logs = torch.where(w > 0, w.clamp_min(1e-300).log(), torch.zeros_like(w))
    return {"max_weight": w.max(-1).values, "neg_entropy": (w * logs).sum(-1)}


def confidence_correlation(confidence: Tensor, correct: Tensor) -> dict[str, float]:
    """How a confidence signal (B,) relates to correctness (B,) boolean:

    - ``auroc``: P(confidence of a correct example > that of a wrong one), ties counting ½
      (the Mann-Whitney statistic; 0.5 = no signal);
    - ``point_biserial``: Pearson correlation between confidence and correctness as 0/1.

    Both are NaN when every prediction is right or every one wrong.
    """
    if confidence.shape != correct.shape or confidence.dim() != 1:
        raise ValueError(
            f"confidence {tuple(confidence.shape)} and correct {tuple(correct.shape)} must both "
            "be (B,)"
        )
    if correct.dtype != torch.bool:
        raise TypeError(f"correct must be boolean, got {correct.dtype}")
    c = confidence.double()
    right, wrong = c[correct], c[~correct]
    if right.numel() == 0 or wrong.numel() == 0:
        return {"auroc": float("nan"), "point_biserial": float("nan")}
    diff = right.unsqueeze(1) - wrong.unsqueeze(0)
    auroc = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    y = correct.double()
    cc, yc = c - c.mean(), y - y.mean()
    denom = float(cc.norm() * yc.norm())
    pb = float((cc * yc).sum()) / denom if denom > 0 else float("nan")
    return {"auroc": auroc, "point_biserial": pb}
