"""The report: metrics explained in the task's order, heatmaps with colour bar and axis titles
and no overlapping text, square grids for images, integer epoch ticks, validation panel, the
environment of the run."""

import json
import platform
from itertools import combinations

import matplotlib.pyplot as plt
import numpy as np
import torch

from attnkit.experiments import environment
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


def test_a_story_heatmap_keeps_its_sentences_titles_and_colour_bar_apart():
    """Sentences of a story down the side, hops along the bottom, a long title: no two texts
    overlap, none runs into the heatmap or the colour bar or off the figure."""
    sentences = [f"{i + 1}. sandra journeyed to the bathroom with the football" for i in range(12)]
    gold = np.zeros((12, 3), dtype=bool)
    gold[4] = True
    item = {
        "title": "where is the football? answer hallway, predicted bathroom; " * 3,
        "weights": np.random.default_rng(0).random((12, 3)),
        "gold": gold,
        "x_labels": ["hop 1", "hop 2", "hop 3"],
        "y_labels": sentences,
        "x_title": "hop",
        "y_title": "memory (sentence of the story)",
    }
    fig = heatmap_figure(item)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    main, bar = fig.axes
    ticks = [t for t in [*main.get_xticklabels(), *main.get_yticklabels()] if t.get_text()]
    assert len(ticks) == 15  # every sentence and hop labelled
    texts = [*ticks, fig._suptitle, main.title, main.xaxis.label, main.yaxis.label]
    boxes = [t.get_window_extent(renderer) for t in texts]
    assert not [
        (a.get_text(), b.get_text())
        for (a, p), (b, q) in combinations(zip(texts, boxes, strict=True), 2)
        if p.overlaps(q)
    ]
    for box in [*boxes, main.get_window_extent()]:
        assert not box.overlaps(bar.get_tightbbox(renderer))
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1  # inside the figure
        assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    for box in boxes[-4:-2]:  # the titles stay off the heatmap
        assert not box.overlaps(main.get_window_extent())
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


def test_write_report_shows_and_saves_the_environment(tmp_path):
    env = environment.collect(
        threads=3, processes=2, wall_seconds=75.0, train_seconds=42.0,
        argv=["/somewhere/bin/attnkit", "run", "--task", "copy", "--note", "two words"],
    )  # fmt: skip
    path = write_report(tmp_path, {"task": "x"}, {"a_error": 0.1}, [], [], INFO, environment=env)
    page = path.read_text()
    assert "<h2>Environment</h2>" in page
    for text in (
        torch.__version__,
        platform.python_version(),
        "attnkit run --task copy --note &#x27;two words&#x27;",
        "75 s (1 min 15 s)",
        "42.0 s",
        env["processor"],
        platform.platform(),
        "threads used by each process</td><td>3<",
    ):
        assert text in page, text
    assert json.loads((tmp_path / "environment.json").read_text()) == env


def test_write_report_without_environment_writes_no_environment(tmp_path):
    page = write_report(tmp_path, {"task": "x"}, {}, [], [], INFO).read_text()
    assert "Environment" not in page and not (tmp_path / "environment.json").exists()
