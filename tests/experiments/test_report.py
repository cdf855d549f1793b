"""The report: metrics explained in the task's order, heatmaps with colour bar and axis titles,
square grids for images, integer epoch ticks, validation panel."""

import matplotlib.pyplot as plt
import numpy as np

from attnkit.experiments.report import curves_figure, heatmap_figure, metric_rows, write_report
from attnkit.tasks.base import Metric

INFO = {"b_first": Metric("shown first"), "a_error": Metric("an error rate", "lower")}


def test_metric_rows_follow_the_task_order_and_say_which_way_is_better():
    rows = metric_rows({"a_error": 0.25, "zzz": 1.0, "b_first": 0.5}, INFO)
    assert [r[0] for r in rows] == ["b_first", "a_error", "zzz"]
    assert rows[0][2:] == ["higher is better", "shown first"]
    assert rows[1][1:3] == ["0.2500", "lower is better"]
    assert rows[2][2:] == ["", ""]


def _labels(ax):
    return ax.get_xlabel(), ax.get_ylabel()


def test_sequence_heatmap_has_a_colour_bar_and_axis_titles():
    item = {
        "title": "t",
        "weights": np.full((2, 3), 1 / 3),
        "gold": np.eye(2, 3, dtype=bool),
        "x_labels": list("abc"),
        "y_labels": list("xy"),
        "x_title": "input character",
        "y_title": "predicted output character",
    }
    fig = heatmap_figure(item)
    main, bar = fig.axes
    assert _labels(main) == ("input character", "predicted output character")
    assert bar.get_ylabel() == "weight"
    assert [t.get_text() for t in main.get_yticklabels()] == ["x", "y"]
    plt.close(fig)


def test_image_heatmap_keeps_cells_square():
    item = {
        "title": "t",
        "weights": np.random.rand(4, 4),
        "gold": np.zeros((4, 4), dtype=bool),
        "image": np.random.rand(16, 16),
        "x_title": "grid column",
        "y_title": "grid row",
    }
    fig = heatmap_figure(item)
    _, grid_ax, bar = fig.axes
    assert grid_ax.get_aspect() == 1.0 and _labels(grid_ax) == ("grid column", "grid row")
    assert bar.get_ylabel() == "weight"
    plt.close(fig)


def test_curves_have_integer_epoch_ticks_and_a_filled_validation_panel():
    history = [{"epoch": e, "loss": 1.0 / e, "val_accuracy": 0.1 * e} for e in (1, 2, 3)]
    fig = curves_figure(history)
    loss_ax, val_ax = fig.axes
    fig.canvas.draw()
    for ax in (loss_ax, val_ax):
        ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert [line.get_label() for line in val_ax.get_lines()] == ["accuracy"]
    plt.close(fig)


def test_the_validation_panel_shows_metrics_with_a_direction_and_says_it():
    history = [{"epoch": 1, "loss": 1.0, "val_b_first": 0.5, "val_a_error": 0.2, "val_h": 4.0}]
    fig = curves_figure(history, {**INFO, "h": Metric("entropy", None)})
    labels = [line.get_label() for line in fig.axes[1].get_lines()]
    assert labels == ["b_first (higher is better)", "a_error (lower is better)"]
    plt.close(fig)


def test_write_report_explains_the_metrics(tmp_path):
    history = [{"epoch": 1, "loss": 1.0}]
    metrics = {"a_error": 0.1, "b_first": 0.9}
    path = write_report(tmp_path, {"task": "x"}, metrics, history, [], INFO)
    page = path.read_text()
    assert page.index("b_first") < page.index("a_error")
    assert "lower is better" in page and "an error rate" in page
    assert (tmp_path / "curves.png").exists()
