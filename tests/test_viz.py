"""attnkit.viz: what each plot draws (labels, gold markers, one panel per head, the curve's
points), and errors naming the argument."""

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
    (points,) = ax.collections
    assert points.get_offsets().tolist() == [[0, 0], [2, 1]]  # (column, row) of gold links
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
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(shown) == 5 and len(fig.axes) == 6  # 3 rows of 2, the last panel hidden
    assert [ax.get_title() for ax in shown][:2] == [
        "head 0 (entropy 0.00)",
        "head 1 (entropy 1.00)",
    ]
    plt.close(fig)


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
