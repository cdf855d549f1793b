"""The report's interactive views of its held-out examples (drawn by
:func:`attnkit.viz.head_view_div` and :func:`attnkit.viz.token_highlight_div`).

An example of :meth:`attnkit.tasks.base.Task.heatmaps` with one query row (a learned query
over words) is shown as its words coloured by weight, gold words underlined; any other
labelled example as a head view, queries on the left and keys on the right. An example that
also carries ``attention`` (L, H, M, N): the weights of every layer and head, with
``layer_names`` optionally, gets its layers and heads in the view; ``weights`` stays the one
matrix of the static heatmap. Image grids and weights outside [0, 1] (signed relevance) have
no interactive view; neither do matrices of more than :data:`MAX_CELLS` cells, whose lines a
page could not draw usefully.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnkit.viz_html import head_view_div, token_highlight_div, view_assets

__all__ = ["MAX_CELLS", "interactive_section"]

MAX_CELLS = 40_000  # query × key pairs in one head's matrix

_ABOUT = (
    "<p>The same examples to explore. Head views: queries on the left, keys on the right, one "
    "line per non-zero weight, its opacity the weight and its colour the head's; click a head "
    "to show or hide it (double click: that head alone), choose the layer from the menu, point "
    "at a token to see only its lines. One-query examples: the words coloured by their weight"
)


def _view(item: dict) -> str | None:
    if "image" in item or item.get("x_labels") is None or item.get("y_labels") is None:
        return None
    attention = item.get("attention")
    a = np.asarray(item["weights"] if attention is None else attention, dtype=np.float64)
    if a.size == 0 or not np.isfinite(a).all() or a.min() < 0 or a.max() > 1 + 1e-5:
        return None
    if a.shape[-2] * a.shape[-1] > MAX_CELLS:
        return None
    if attention is None and a.shape[0] == 1:
        gold = np.asarray(item["gold"], dtype=bool)[0]
        return token_highlight_div(
            item["x_labels"],
            {str(item["y_labels"][0]): a[0]},
            gold=gold if gold.any() else None,
            title=item["title"],
        )
    return head_view_div(
        a,
        item["y_labels"],
        item["x_labels"],
        layer_names=item.get("layer_names"),
        title=item["title"],
    )


def interactive_section(heatmaps: Sequence[dict]) -> str:
    """The "Interactive view" section of the report for the task's heatmap examples, with the
    views' script and style; empty when no example has a view."""
    views = [v for v in (_view(item) for item in heatmaps) if v is not None]
    if not views:
        return ""
    gold = any(np.asarray(item.get("gold", False), dtype=bool).any() for item in heatmaps)
    about = _ABOUT + (" (gold words underlined).</p>" if gold else ".</p>")
    return "<h2>Interactive view</h2>\n" + about + "\n" + "\n".join(views) + "\n" + view_assets()
