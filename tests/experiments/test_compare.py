"""The combined table of a --compare run."""

from pathlib import Path

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
