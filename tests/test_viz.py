"""attnkit.viz: what each plot draws (labels, gold markers, one panel per head, the curve's
points), that its text stays readable (no two labels or titles overlap, gold boxes as large as
the cells), and errors naming the argument."""

from itertools import combinations

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from attnkit import viz
from attnkit.evaluation.heads import PruningCurve


def test_heatmap_labels_gold_and_colour_bar():
    w = torch.tensor([[0.7, 0.2, 0.1], [0.0, 0.5, 0.5]])
    gold = np.array([[True, False, False], [False, False, True]])
    ax = viz.heatmap(w, x_labels=list("abc"), y_labels=["p", "q"], gold=gold, x_title="in")
    fig = ax.figure
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert ax.get_xlabel() == "in" and ax.get_ylabel() == "query"
    (boxes,) = ax.collections
    centres = [p.get_extents().get_points().mean(0).tolist() for p in boxes.get_paths()]
    assert centres == [[0, 0], [2, 1]]  # (column, row) of the gold links
    np.testing.assert_allclose(ax.images[0].get_array(), w.numpy())
    assert ax.images[0].get_clim()[0] == 0 and len(fig.axes) == 2  # colour bar
    plt.close(fig)


def test_heatmap_of_signed_weights_does_not_clip_at_zero():
    ax = viz.heatmap(np.array([[-0.2, 0.6]]), colorbar=False)
    assert ax.images[0].get_clim()[0] == pytest.approx(-0.2)
    assert len(ax.figure.axes) == 1
    plt.close(ax.figure)


def test_head_grid_one_panel_per_head_with_statistics():
    w = np.random.default_rng(0).random((5, 3, 3))
    fig = viz.head_grid(w, statistics={"entropy": np.arange(5.0)}, ncols=2)
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.images]
    hidden = [ax for ax in fig.axes if not ax.get_visible()]
    assert len(shown) == 5 and len(hidden) == 1  # 3 rows of 2, the last panel hidden
    assert [ax.get_title() for ax in shown][:2] == [
        "head 0 (entropy 0.00)",
        "head 1 (entropy 1.00)",
    ]
    plt.close(fig)


def _shown(labels):
    return [t for t in labels if t.get_visible() and t.get_text()]


def _overlapping(texts, renderer):
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for (a, p), (b, q) in combinations(boxes, 2) if p.overlaps(q)]


def _cell_pixels(ax):
    (x0, y0), (x1, y1) = ax.transData.transform([(0, 0), (1, 1)])
    return abs(x1 - x0), abs(y1 - y0)


@pytest.mark.parametrize("n", [3, 40])
def test_gold_boxes_are_as_large_as_the_cells(n):
    gold = np.zeros((n, n), dtype=bool)
    gold[0, 0] = gold[n - 1, n // 2] = True
    ax = viz.heatmap(np.random.default_rng(0).random((n, n)), gold=gold)
    ax.figure.canvas.draw()
    cell_w, cell_h = _cell_pixels(ax)
    (boxes,) = ax.collections
    assert len(boxes.get_paths()) == 2
    for path in boxes.get_paths():
        drawn = path.transformed(ax.transData).get_extents()
        assert 0.8 * cell_w <= drawn.width <= cell_w and 0.8 * cell_h <= drawn.height <= cell_h
    plt.close(ax.figure)


def test_head_grid_of_48_tokens_has_one_colour_bar_and_no_overlapping_text():
    w = np.random.default_rng(1).dirichlet(np.ones(48), size=(6, 48))
    tokens = [f"token{i}" for i in range(48)]
    fig = viz.head_grid(
        w, x_labels=tokens, y_labels=tokens, gold=np.eye(48, dtype=bool), ncols=3,
        statistics={"entropy": np.arange(6.0)}, title="layer 3 of a model " * 8,
    )  # fmt: skip
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    heads = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if not ax.images and ax.get_visible()]
    assert len(heads) == 6 and len(bars) == 1 and bars[0].get_ylabel() == "weight"
    # one scale for every head: the colour limits are the weights' extremes over all heads
    assert {ax.images[0].get_clim() for ax in heads} == {(0.0, w.max())}
    for ax in heads:
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            shown = _shown(labels)
            assert not _overlapping(shown, renderer)
            if shown:  # every k-th token, starting at the first
                index = [tokens.index(t.get_text()) for t in shown]
                k = index[1] - index[0]
                assert index == list(range(0, 48, k)) and k < 8
    # labels on the left column and the bottom row only
    assert sum(bool(_shown(ax.get_yticklabels())) for ax in heads) == 2
    assert sum(bool(_shown(ax.get_xticklabels())) for ax in heads) == 3
    titles = [fig._suptitle] + [ax.title for ax in heads]
    assert not _overlapping(titles, renderer)
    for text in [*titles, *(t for ax in heads for t in _shown(ax.get_yticklabels()))]:
        box = text.get_window_extent(renderer)  # inside the figure
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1
    for ax in heads:  # no title runs into a panel
        for other in heads:
            assert not ax.title.get_window_extent(renderer).overlaps(other.get_window_extent())
        assert not fig._suptitle.get_window_extent(renderer).overlaps(ax.get_window_extent())
    plt.close(fig)


def test_long_labels_are_shortened_and_many_labels_get_smaller():
    long = "a sentence far too long to fit beside a heatmap without being cut short"
    ax = viz.heatmap(np.ones((2, 2)), y_labels=[long, "short"], x_labels=["a", "b"])
    ax.figure.canvas.draw()
    first, second = (t.get_text() for t in ax.get_yticklabels())
    assert first.endswith("…") and long.startswith(first[:-1]) and len(first) <= 40
    assert second == "short"
    few = ax.get_yticklabels()[0].get_fontsize()
    many = viz.heatmap(np.ones((40, 40)), y_labels=[str(i) for i in range(40)])
    assert many.get_yticklabels()[0].get_fontsize() < few
    plt.close("all")


def test_pruning_curve_plots_the_points():
    curve = PruningCurve([0, 1, 2], [0.0, 0.25, 0.5], [0.9, 0.8, 0.4], [("a", 0), ("a", 1)])
    ax = viz.pruning_curve(curve, metric_name="accuracy")
    (line,) = ax.get_lines()
    assert line.get_xdata().tolist() == [0.0, 0.25, 0.5]
    assert line.get_ydata().tolist() == [0.9, 0.8, 0.4]
    assert ax.get_ylabel() == "accuracy"
    plt.close(ax.figure)


def test_importance_comparison_scales_each_measure_and_marks_gold():
    fig = viz.importance_comparison(
        {"attention": [0.5, 0.25, 0.25], "gradient": [-2.0, 1.0, 0.0]},
        labels=["x", "y", "z"],
        gold=[False, True, False],
    )
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    assert heights == [1.0, 0.5, 0.5, -1.0, 0.5, 0.0]
    assert [t.get_color() == "red" for t in ax.get_xticklabels()] == [False, True, False]
    png = viz.to_png(fig)
    assert png.startswith(b"\x89PNG")


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="weights must have 2 dims"):
        viz.heatmap(np.zeros(3))
    with pytest.raises(ValueError, match="x_labels has 2 labels for 3"):
        viz.heatmap(np.zeros((1, 3)), x_labels=["a", "b"])
    with pytest.raises(ValueError, match="gold"):
        viz.heatmap(np.zeros((1, 3)), gold=np.zeros((3, 1)))
    with pytest.raises(ValueError, match="statistics"):
        viz.head_grid(np.zeros((2, 1, 1)), statistics={"e": [1.0]})
    with pytest.raises(TypeError, match="curve"):
        viz.pruning_curve([1, 2])
    with pytest.raises(ValueError, match="measures"):
        viz.importance_comparison({"a": [1.0], "b": [1.0, 2.0]})
    plt.close("all")
