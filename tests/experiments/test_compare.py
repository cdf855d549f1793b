"""The combined table of a --compare run."""

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from attnkit.experiments.compare import markdown_table, write_comparison
from attnkit.tasks.base import Metric

INFO = {"acc": Metric("accuracy"), "err": Metric("error", "lower")}
VARIANTS = [
    ("dot", Path("cmp/score-dot"), {"err": 0.25, "acc": 0.5}),
    ("general", Path("cmp/score-general"), {"acc": 0.75, "err": 0.125}),
]


def test_markdown_table_has_one_row_per_variant_in_the_task_order():
    lines = markdown_table("score", VARIANTS, INFO).splitlines()
    assert lines[0] == "| score | acc (higher is better) | err (lower is better) | report |"
    assert lines[2] == "| dot | 0.500 | 0.250 | cmp/score-dot/report.html |"
    assert lines[3] == "| general | 0.750 | 0.125 | cmp/score-general/report.html |"


def test_write_comparison_links_each_report(tmp_path):
    variants = [(v, tmp_path / d.name, m) for v, d, m in VARIANTS]
    page = write_comparison(tmp_path, "score", variants, INFO).read_text()
    assert 'href="score-dot/report.html"' in page and "lower is better" in page
    assert len((tmp_path / "compare.md").read_text().splitlines()) == 2 + len(variants)


# A grid over lr and seed: the summary's mean ± std is checked against numpy (ddof=1).
GRID = [
    (("0.1", "0"), Path("g/lr-0.1_seed-0"), {"acc": 0.5, "err": 0.5}),
    (("0.1", "1"), Path("g/lr-0.1_seed-1"), {"acc": 0.75, "err": 0.25}),
    (("0.1", "2"), Path("g/lr-0.1_seed-2"), {"acc": 0.875, "err": 0.25}),
    (("0.2", "0"), Path("g/lr-0.2_seed-0"), {"acc": 0.25}),
]


def _reference(values):
    import numpy as np

    a = np.array(values, dtype=float)
    return f"{a.mean():.3f}" + (f" ± {a.std(ddof=1):.3f}" if len(a) > 1 else "")


def test_seed_summary_groups_the_other_keys_with_mean_and_sample_std():
    from attnkit.experiments.compare import seed_summary, summary_table

    groups = seed_summary(("lr", "seed"), GRID)
    assert [(rest, n) for rest, n, _ in groups] == [(("0.1",), 3), (("0.2",), 1)]
    lines = summary_table(("lr", "seed"), GRID, INFO).splitlines()
    assert lines[0].startswith("| lr | n | acc (higher is better) mean ± std |")
    acc, err = _reference([0.5, 0.75, 0.875]), _reference([0.5, 0.25, 0.25])
    assert lines[2] == f"| 0.1 | 3 | {acc} | {err} |"
    assert lines[3] == f"| 0.2 | 1 | {_reference([0.25])} |  |"  # n = 1: no spread
    with pytest.raises(ValueError, match="'seed' is not one of the compared keys"):
        seed_summary(("lr",), GRID)


def test_a_metric_missing_from_some_seeds_says_how_many_gave_it():
    from attnkit.experiments.compare import summary_table

    rows = [(("a", "0"), Path("x"), {"acc": 0.5}), (("a", "1"), Path("y"), {"acc": 1.0,
            "err": 0.5})]  # fmt: skip
    line = summary_table(("score", "seed"), rows, INFO).splitlines()[2]
    assert line == f"| a | 2 | {_reference([0.5, 1.0])} | {_reference([0.5])} (n=1) |"


def test_with_seed_compared_the_summary_comes_before_every_run():
    from attnkit.experiments.compare import markdown

    text = markdown(("lr", "seed"), GRID, INFO)
    summary, _, per_run = text.partition("Each run:")
    assert "mean ± std" in summary and "| lr | n |" in summary
    assert per_run.strip().splitlines()[0].startswith("| lr | seed | acc")
    assert len(per_run.strip().splitlines()) == 2 + len(GRID)
    assert "mean ± std" not in markdown(("score",), VARIANTS, INFO)


def _fake_runs(tmp_path, grid):
    """Run directories with an epochs.csv and two heatmap PNGs each."""
    from attnkit import viz

    runs = []
    for i, (values, directory, metrics) in enumerate(grid):
        run_dir = tmp_path / directory.name
        run_dir.mkdir()
        rows = [f"{e},{1.0 / (e + i)},{0.1 * e + 0.01 * i}" for e in (1, 2, 3)]
        (run_dir / "epochs.csv").write_text("epoch,loss,val_acc\n" + "\n".join(rows) + "\n")
        for k in range(2):
            fig = plt.figure(figsize=(1, 1))
            fig.text(0.5, 0.5, f"{i}-{k}")
            (run_dir / f"heatmap_{k}.png").write_bytes(viz.to_png(fig, dpi=20))
        runs.append((values, run_dir, metrics))
    return runs


def test_the_curves_overlay_every_run_and_seeds_share_a_labelled_colour(tmp_path):
    from attnkit.experiments.compare import curves_figure

    runs = _fake_runs(tmp_path, GRID)
    fig = curves_figure(("lr", "seed"), runs, INFO)
    loss, acc = fig.axes[:2]
    assert len(loss.lines) == len(acc.lines) == len(GRID)
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["lr=0.1", "lr=0.2"]
    colours = [line.get_color() for line in loss.lines]
    assert colours[0] == colours[1] == colours[2] != colours[3]
    assert list(acc.lines[1].get_ydata()) == pytest.approx([0.11, 0.21, 0.31])
    assert "validation acc (higher is better)" in acc.get_title()
    plt.close(fig)


def test_write_comparison_embeds_each_runs_heatmaps_side_by_side(tmp_path):
    import base64

    runs = _fake_runs(tmp_path, GRID[:2])
    page = write_comparison(tmp_path, ("lr", "seed"), runs, INFO).read_text()
    for _, run_dir, _ in runs:
        for k in range(2):
            encoded = base64.b64encode((run_dir / f"heatmap_{k}.png").read_bytes()).decode()
            assert encoded in page
    assert page.count("<h3>Example") == 2 and "lr=0.1, seed=1" in page
    assert (tmp_path / "compare_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "Held-out metrics over seeds" in page and 'href="lr-0.1_seed-0/report.html"' in page
