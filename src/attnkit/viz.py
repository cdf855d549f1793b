"""Plots of attention for a user's own model, the same functions the run report uses
(Brauwers 4.2 and Galassi VI: inspection by heatmaps).

- :func:`heatmap`: one weight matrix with token labels, gold links outlined, colour bar.
- :func:`head_grid`: one heatmap per head, with per-head statistics in the titles and one
  shared colour bar.
- :func:`heatmap_size`: a figure size that gives a heatmap's cells and labels room.
- :func:`pruning_curve`: the metric as heads are removed (Michel et al. 2019).
- :func:`importance_comparison`: attention and other importance measures side by side over
  the items of one example, gold items marked.
- :func:`to_png`: a figure as PNG bytes (and closed).
- :func:`head_view`, :func:`token_highlight`: interactive HTML views (layers, heads, lines
  between tokens; tokens coloured by attribution), from :mod:`attnkit.viz_html`.

Every plotting function takes arrays or tensors (converted with ``numpy.asarray`` after
detaching) and returns matplotlib objects; nothing is shown or saved unless asked.
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import PatchCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Rectangle
from matplotlib.textpath import TextToPath
from matplotlib.ticker import FuncFormatter, Locator

from attnkit.viz_html import (
    head_view,
    head_view_div,
    token_highlight,
    token_highlight_div,
    view_assets,
)

__all__ = [
    "head_grid",
    "head_view",
    "head_view_div",
    "heatmap",
    "heatmap_size",
    "importance_comparison",
    "pruning_curve",
    "to_png",
    "token_highlight",
    "token_highlight_div",
    "view_assets",
]


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


# Longest tick label shown, in characters; longer ones end in "…" (the full text stays in the
# caller's data).
_MAX_Y_LABEL = 40
_MAX_X_LABEL = 24


def _short(labels: Sequence[Any], limit: int) -> list[str]:
    out = []
    for label in labels:
        text = " ".join(str(label).split())
        out.append(text if len(text) <= limit else text[: limit - 1].rstrip() + "…")
    return out


def _font_size(n: int) -> float:
    """Tick label size by the number of labels: smaller when there are many."""
    return 8.0 if n <= 12 else 7.0 if n <= 24 else 6.0


def _text_width(texts: Sequence[str], size: float) -> float:
    """Width in points of the widest text at font ``size``."""
    prop = FontProperties(size=size)
    measure = TextToPath().get_text_width_height_descent
    return max((measure(t, prop, ismath=False)[0] for t in texts), default=0.0)


class _EveryKth(Locator):
    """Ticks at the cells 0, k, 2k, … with the smallest k at which labels ``need`` points long
    (along the axis) do not overlap, found from the axes' size when it is drawn (so after the
    layout has placed it)."""

    def __init__(self, n: int, need: float) -> None:
        self.n = n
        self.need = need

    def __call__(self) -> np.ndarray:
        return self.tick_values(*self.axis.get_view_interval())

    def tick_values(self, vmin: float, vmax: float) -> np.ndarray:
        axis = getattr(self, "axis", None)
        k = 1
        if axis is not None:
            box = axis.axes.get_window_extent()
            length = box.width if axis.axis_name == "x" else box.height
            span = abs(vmax - vmin) or 1.0
            cell = length / span  # pixels per cell
            need = self.need * axis.axes.figure.dpi / 72
            k = max(1, math.ceil(need / cell)) if cell > 0 else self.n
        return np.arange(0, self.n, k)


def _set_tick_labels(ax: Axes, which: str, labels: Sequence[Any], cell_points: float) -> None:
    """Label the cells along ``which`` ("x" or "y"): long labels shortened, the font smaller when
    there are many, x labels turned upright when they are wider than a cell (``cell_points``,
    the estimated cell width), and only every k-th label shown when they would overlap."""
    n = len(labels)
    size = _font_size(n)
    texts = _short(labels, _MAX_X_LABEL if which == "x" else _MAX_Y_LABEL)
    height = 1.35 * size  # a line of text and the gap to the next
    upright = False
    if which == "x":
        width = _text_width(texts, size) + 0.6 * size
        # the estimate is made before the layout: upright only when clearly too wide
        upright = width > 1.3 * cell_points and width > height
        need = height if upright else width
    else:
        need = height
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(_EveryKth(n, need))
    axis.set_major_formatter(
        FuncFormatter(lambda v, _: texts[round(v)] if 0 <= round(v) < n else "")
    )
    ax.tick_params(axis=which, labelsize=size, labelrotation=90 if upright else 0)


def _wrap(text: str, width_points: float, size: float) -> str:
    """``text`` broken into lines about ``width_points`` wide at font ``size``."""
    chars = max(16, int(width_points / (0.55 * size)))
    return "\n".join(textwrap.wrap(text, chars)) or text


def _axes_points(ax: Axes) -> tuple[float, float]:
    """The axes' width and height in points as placed now (before any layout)."""
    fig_w, fig_h = ax.figure.get_size_inches()
    pos = ax.get_position()
    return pos.width * fig_w * 72, pos.height * fig_h * 72


def heatmap_size(
    shape: tuple[int, int],
    x_labels: Sequence[Any] | None = None,
    y_labels: Sequence[Any] | None = None,
    colorbar: bool = True,
) -> tuple[float, float]:
    """A figure size (inches) for a heatmap of ``shape`` (rows, columns): cells of about a
    quarter inch (smaller for large matrices), room for the labels as drawn by :func:`heatmap`
    and the colour bar; at most 14 inches either way."""
    m, n = shape
    cell = 0.3 if max(m, n) <= 24 else 0.16
    col = cell
    label_w = _text_width(_short(y_labels, _MAX_Y_LABEL), _font_size(m)) / 72 if y_labels else 0.2
    label_h = 0.2
    if x_labels:
        size = _font_size(n)
        width = (_text_width(_short(x_labels, _MAX_X_LABEL), size) + 0.8 * size) / 72
        if width <= 0.6:  # widen the columns to keep the labels across
            col = max(cell, 1.15 * width)
        else:  # drawn upright
            label_h = width
    w = label_w + 0.5 + n * col + (1.1 if colorbar else 0.2)
    h = label_h + 0.5 + m * cell + 0.7
    return min(max(w, 4.0), 14.0), min(max(h, 2.2), 14.0)


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
    vmin: float | None = None,
    vmax: float | None = None,
) -> Axes:
    """Draw weights (M, N) on ``ax`` (a new figure, sized by :func:`heatmap_size`, when None):
    rows are queries, columns keys; each ``gold`` (M, N) link is outlined in red, the outline
    as large as its cell. The colour scale starts at 0 unless a weight is negative (effective
    attention), or runs over ``vmin``–``vmax`` when given (one scale for several panels).

    Labels stay readable: long ones are shortened with "…", the font shrinks with their
    number, x labels wider than a cell are turned upright and, where labels would still
    overlap, only every k-th is shown. Returns the axes."""
    w = _array(weights, "weights", 2)
    _check_labels(x_labels, w.shape[1], "x_labels")
    _check_labels(y_labels, w.shape[0], "y_labels")
    if ax is None:
        size = heatmap_size(w.shape, x_labels, y_labels, colorbar)
        _, ax = plt.subplots(figsize=size, layout="constrained")
    if vmin is None and np.nanmin(w, initial=0.0) >= 0:
        vmin = 0.0
    shown = ax.imshow(w, cmap="viridis", aspect=aspect, vmin=vmin, vmax=vmax)
    width, height = _axes_points(ax)
    if gold is not None:
        g = _array(gold, "gold", 2).astype(bool)
        if g.shape != w.shape:
            raise ValueError(f"gold {g.shape} must have the weights' shape {w.shape}")
        _outline(ax, g, min(width / w.shape[1], height / w.shape[0]))
    if x_labels is not None:
        _set_tick_labels(ax, "x", x_labels, width / w.shape[1])
    if y_labels is not None:
        _set_tick_labels(ax, "y", y_labels, height / w.shape[0])
    ax.set_xlabel(x_title)
    ax.set_ylabel(y_title)
    if title is not None:
        ax.set_title(_wrap(title, width, 8), fontsize=8)
    if colorbar:
        ax.figure.colorbar(shown, ax=ax, fraction=0.046, pad=0.04, label="weight")
    return ax


def _outline(ax: Axes, gold: np.ndarray, cell_points: float) -> None:
    """A red box around each gold cell, inset a little so neighbouring boxes stay apart, its
    line width growing with the cell (``cell_points``, estimated)."""
    rows, cols = np.nonzero(gold)
    inset = 0.06
    boxes = [
        Rectangle((c - 0.5 + inset, r - 0.5 + inset), 1 - 2 * inset, 1 - 2 * inset)
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True)
    ]
    lw = float(np.clip(0.09 * cell_points, 0.8, 2.5))
    ax.add_collection(
        PatchCollection(boxes, facecolors="none", edgecolors="red", linewidths=lw, label="gold"),
        autolim=False,
    )


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
    :func:`attnkit.evaluation.head_statistics`). All heads share one colour scale and one
    colour bar; token labels are drawn on the left column and the bottom row only (every k-th
    where they would overlap)."""
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
    side = min(max(2.8, 0.05 * max(w.shape[1:]) + 1.4), 5.0)  # inches per panel
    fig, axes = plt.subplots(
        rows, cols, figsize=(side * cols + 1.0, side * rows + 0.4), squeeze=False,
        layout="constrained",
    )  # fmt: skip
    lo = 0.0 if np.nanmin(w, initial=0.0) >= 0 else float(np.nanmin(w))
    hi = float(np.nanmax(w, initial=lo))
    shown = []
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
            vmin=lo,
            vmax=hi if hi > lo else None,
        )
        bottom = i + cols >= h  # no visible panel below
        if not bottom:
            ax.set_xlabel("")
            ax.tick_params(axis="x", labelbottom=False)
        if i % cols:
            ax.set_ylabel("")
            ax.tick_params(axis="y", labelleft=False)
        shown.append(ax)
    fig.colorbar(
        shown[0].images[0], ax=shown, label="weight", fraction=0.03, aspect=30,
        shrink=min(1.0, 0.6 + 0.2 * rows),
    )  # fmt: skip
    if title is not None:
        fig.suptitle(_wrap(title, fig.get_size_inches()[0] * 72, 9), fontsize=9)
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
