"""Precision, recall and F1 for classification and tagging (Brauwers Sec. 4.1; Galassi VI: the
task metrics attention models report), micro- and macro-averaged. Written from the definitions;
the tests check them against scikit-learn's ``precision_recall_fscore_support``."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PrecisionRecallF1", "precision_recall_f1"]

AVERAGES = ("micro", "macro", "weighted", None)


@dataclass(frozen=True)
class PrecisionRecallF1:
    """Precision, recall and F1: floats when averaged, else one value per label (in
    ``labels`` order); ``support`` is the number of true items of each label (its sum when
    averaged)."""

    precision: float | list[float]
    recall: float | list[float]
    f1: float | list[float]
    support: int | list[int]
    labels: list[Hashable]


def _items(x: object, name: str) -> list[Hashable]:
    if isinstance(x, Tensor):
        if x.dim() != 1 or x.is_floating_point() or x.is_complex():
            raise ValueError(
                f"{name} must be a 1-D integer or boolean Tensor of labels, got dtype {x.dtype} "
                f"shape {tuple(x.shape)}"
            )
        return x.tolist()
    if isinstance(x, str) or not isinstance(x, Sequence):
        raise TypeError(f"{name} must be a sequence of labels or a 1-D Tensor, got {x!r}")
    for v in x:
        if not isinstance(v, Hashable) or isinstance(v, float):
            raise TypeError(f"{name}: labels must be hashable and not float, got {v!r}")
    return list(x)


def precision_recall_f1(
    y_true: Sequence[Hashable] | Tensor,
    y_pred: Sequence[Hashable] | Tensor,
    *,
    average: str | None = "macro",
    labels: Sequence[Hashable] | None = None,
    zero_division: float = 0.0,
) -> PrecisionRecallF1:
    """Per label c: P_c = TP_c / (TP_c + FP_c), R_c = TP_c / (TP_c + FN_c),
    F1_c = 2 P_c R_c / (P_c + R_c).

    - ``average="micro"``: TP, FP, FN summed over ``labels`` first (for single-label
      classification over all labels, micro P = R = F1 = accuracy);
    - ``"macro"``: the unweighted mean of the per-label values (macro F1 is the mean of the
      F1_c, not the F1 of macro P and R);
    - ``"weighted"``: the mean weighted by each label's support (unweighted when no scored
      label occurs in ``y_true``);
    - None: the per-label values.

    A ratio whose denominator is 0 (a label never predicted, or absent from ``y_true``) is
    ``zero_division``, as scikit-learn's argument of that name.

    Args:
        y_true, y_pred: one label per item (any hashable labels other than floats, or 1-D
            integer Tensors), the same length.
        labels: the labels scored, in order; default: every label seen in either, sorted.
    """
    t, p = _items(y_true, "y_true"), _items(y_pred, "y_pred")
    if len(t) != len(p):
        raise ValueError(f"y_true ({len(t)} items) and y_pred ({len(p)} items) must pair up")
    if not t:
        raise ValueError("precision_recall_f1: no items to score")
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    if isinstance(zero_division, bool) or not isinstance(zero_division, int | float):
        raise TypeError(f"zero_division must be a number, got {zero_division!r}")
    if labels is None:
        try:
            labels = sorted(set(t) | set(p))
        except TypeError as err:
            raise TypeError("labels of mixed types cannot be sorted: pass labels=") from err
    else:
        labels = _items(labels, "labels")
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be non-empty and without repeats, got {labels!r}")
    index = {c: i for i, c in enumerate(labels)}
    k = len(labels)
    tp, fp, fn = (torch.zeros(k, dtype=torch.float64) for _ in range(3))
    for a, b in zip(t, p, strict=True):
        if a == b and a in index:
            tp[index[a]] += 1
            continue
        if b in index:
            fp[index[b]] += 1
        if a in index:
            fn[index[a]] += 1
    support = tp + fn

    def ratio(num: Tensor, den: Tensor) -> Tensor:
        return torch.where(den > 0, num / den.clamp_min(1), torch.full_like(num, zero_division))

    if average == "micro":
        stp, sfp, sfn = tp.sum(), fp.sum(), fn.sum()
        pr, rc = ratio(stp, stp + sfp), ratio(stp, stp + sfn)
        f = ratio(2 * stp, 2 * stp + sfp + sfn)  # = 2PR / (P + R)
        return PrecisionRecallF1(float(pr), float(rc), float(f), int(support.sum()), list(labels))
    pr, rc = ratio(tp, tp + fp), ratio(tp, tp + fn)
    f = ratio(2 * tp, 2 * tp + fp + fn)
    if average is None:
        return PrecisionRecallF1(
            pr.tolist(), rc.tolist(), f.tolist(), [int(s) for s in support], list(labels)
        )
    total = support.sum()
    if average == "macro" or total == 0:  # no support anywhere: unweighted, as scikit-learn
        w = torch.full((k,), 1.0 / k, dtype=torch.float64)
    else:
        w = support / total
    return PrecisionRecallF1(
        float((pr * w).sum()),
        float((rc * w).sum()),
        float((f * w).sum()),
        int(support.sum()),
        list(labels),
    )
