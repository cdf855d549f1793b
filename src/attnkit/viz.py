"""Plots of attention for a user's own model, the same functions the run report uses
(Brauwers 4.2 and Galassi VI: inspection by heatmaps).

- :func:`heatmap`: one weight matrix with token labels, gold links circled, colour bar.
- :func:`head_grid`: one heatmap per head, with per-head statistics in the titles.
- :func:`pruning_curve`: the metric as heads are removed (Michel et al. 2019).
- :func:`importance_comparison`: attention and other importance measures side by side over
  the items of one example, gold items marked.
- :func:`to_png`: a figure as PNG bytes (and closed).

Every function takes arrays or tensors (converted with ``numpy.asarray`` after detaching) and
returns matplotlib objects; nothing is shown or saved unless asked.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["head_grid", "heatmap", "importance_comparison", "pruning_curve", "to_png"]


def _array(x: Any, name: str, dims: int | None = None) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x)
    if dims is not None and a.ndim != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {a.shape}")
    return a


def _check_labels(labels: Sequence[str] | None, n: int, name: str) -> None:
    if labels is not None and len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels for {n} positions")


def heatmap(
    weights: Any,
    *,
    ax: Axes | None = None,
    x_labels: Sequence[str] | None = None,
    y_labels: Sequence[str] | None = None,
    gold: Any = None,
    x_title: str = "key",
    y_title: str = "query",
    title: str | None = None,
    colorbar: bool = True,
    aspect: str = "auto",
) -> Axes:
    """Draw weights (M, N) on ``ax`` (a new figure when None): rows are queries, columns keys;
    ``gold`` (M, N) boolean links are circled in red. The colour scale starts at 0 unless a
    weight is negative (effective attention). Returns the axes."""
    w = _array(weights, "weights", 2)
    _check_labels(x_labels, w.shape[1], "x_labels")
    _check_labels(y_labels, w.shape[0], "y_labels")
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4, 0.28 * w.shape[1] + 2), 0.3 * w.shape[0] + 1.6))
    vmin = 0.0 if np.nanmin(w, initial=0.0) >= 0 else None
    shown = ax.imshow(w, cmap="viridis", aspect=aspect, vmin=vmin)
    if gold is not None:
        g = _array(gold, "gold", 2).astype(bool)
        if g.shape != w.shape:
            raise ValueError(f"gold {g.shape} must have the weights' shape {w.shape}")
        ys, xs = np.nonzero(g)
        ax.scatter(xs, ys, s=12, facecolors="none", edgecolors="red", linewidths=0.8, label="gold")
    if x_labels is not None:
        ax.set_xticks(range(len(x_labels)), list(x_labels), fontsize=7)
    if y_labels is not None:
        ax.set_yticks(range(len(y_labels)), list(y_labels), fontsize=7)
    ax.set_xlabel(x_title)
    ax.set_ylabel(y_title)
    if title is not None:
        ax.set_title(title, fontsize=8)
    if colorbar:
        ax.figure.colorbar(shown, ax=ax, fraction=0.046, pad=0.04, label="weight")
    return ax


def head_grid(
    weights: Any,
    *,
    x_labels: Sequence[str] | None = None,
    y_labels: Sequence[str] | None = None,
    gold: Any = None,
    statistics: Mapping[str, Any] | None = None,
    ncols: int = 4,
    title: str | None = None,
) -> Figure:
    """One heatmap per head of weights (H, M, N), ``ncols`` per row, each titled
    ``head h`` plus the per-head ``statistics`` given (name -> (H,), e.g. from
    :func:`attnkit.evaluation.head_statistics`)."""
    w = _array(weights, "weights", 3)
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols must be an int ≥ 1, got {ncols!r}")
    h = w.shape[0]
    stats = {k: _array(v, f"statistics[{k!r}]", 1) for k, v in (statistics or {}).items()}
    for k, v in stats.items():
        if v.shape[0] != h:
            raise ValueError(f"statistics[{k!r}] has {v.shape[0]} values for {h} heads")
    cols = min(ncols, h)
    rows = math.ceil(h / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.set_visible(False)
            continue
        label = ", ".join(f"{k} {v[i]:.2f}" for k, v in stats.items())
        heatmap(
            w[i],
            ax=ax,
            x_labels=x_labels,
            y_labels=y_labels,
            gold=gold,
            title=f"head {i}" + (f" ({label})" if label else ""),
            colorbar=False,
        )
    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def pruning_curve(curve: Any, *, metric_name: str = "metric", ax: Axes | None = None) -> Axes:
    """The metric against the fraction of heads removed, from an
    :class:`attnkit.evaluation.heads.PruningCurve` (or anything with ``fraction`` and
    ``metric``)."""
    if not hasattr(curve, "fraction") or not hasattr(curve, "metric"):
        raise TypeError("curve must have .fraction and .metric (a PruningCurve)")
    if ax is None:
        _, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.plot(list(curve.fraction), list(curve.metric), marker="o")
    ax.set_xlabel("fraction of heads removed (least important first)")
    ax.set_ylabel(metric_name)
    ax.set_title("head pruning curve", fontsize=9)
    return ax


def importance_comparison(
    measures: Mapping[str, Any],
    *,
    labels: Sequence[str] | None = None,
    gold: Any = None,
    title: str | None = None,
) -> Figure:
    """Grouped bars over the N items of one example: each measure (name -> (N,)) scaled by its
    largest absolute value, so rankings can be compared; gold items' labels in red."""
    if not measures:
        raise ValueError("measures must name at least one importance measure")
    arrays = {k: _array(v, f"measures[{k!r}]", 1) for k, v in measures.items()}
    n = next(iter(arrays.values())).shape[0]
    for k, v in arrays.items():
        if v.shape[0] != n:
            raise ValueError(f"measures[{k!r}] has {v.shape[0]} items, expected {n}")
    _check_labels(labels, n, "labels")
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * n + 2), 3.2))
    width = 0.8 / len(arrays)
    for j, (name, v) in enumerate(arrays.items()):
        scale = np.abs(v).max() or 1.0
        ax.bar(np.arange(n) + (j - (len(arrays) - 1) / 2) * width, v / scale, width, label=name)
    ax.set_xticks(range(n), list(labels) if labels is not None else [str(i) for i in range(n)])
    ax.tick_params(axis="x", labelsize=7, rotation=90)
    if gold is not None:
        g = _array(gold, "gold", 1).astype(bool)
        if g.shape[0] != n:
            raise ValueError(f"gold has {g.shape[0]} items, expected {n}")
        for tick, is_gold in zip(ax.get_xticklabels(), g, strict=True):
            if is_gold:
                tick.set_color("red")
    ax.set_xlabel("item (red: gold rationale)" if gold is not None else "item")
    ax.set_ylabel("importance / max |importance|")
    ax.legend(fontsize=7)
    if title is not None:
        ax.set_title(title, fontsize=8)
    return fig


def to_png(fig: Figure, dpi: int = 110) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
