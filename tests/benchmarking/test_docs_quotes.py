"""benchmarks/check_docs_figures.py: the figures the docs quote from RESULTS.md's peer tables
agree with those tables, and the table reader reads what it is given."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "check_docs_figures", ROOT / "benchmarks" / "check_docs_figures.py"
)
figures = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_docs_figures", figures)  # dataclasses look their module up
_spec.loader.exec_module(figures)

TEXT = """# Results

## Flex (2026-11-28)

intro

| pattern | ratio |
|---|---:|
| bigbird | **0.77x** |
| window | 0.90x |
| bigbird | 0.84x |

### Memory

| P | MiB |
|---|---:|
| 1 | 28.4 |

## Later

| pattern | ratio |
|---|---:|
| bigbird | 0.06x |
"""


def test_results_table_reads_the_tables_under_one_heading_only():
    rows = figures.results_table("Flex", 0, TEXT)
    assert [r["pattern"] for r in rows] == ["bigbird", "window", "bigbird"]
    assert figures.results_table("Flex", 1, TEXT) == [{"P": "1", "MiB": "28.4"}]
    with pytest.raises(ValueError, match="'Flex' has 2 tables, not 3"):
        figures.results_table("Flex", 2, TEXT)
    with pytest.raises(ValueError, match="no heading starting with 'Nope'"):
        figures.results_table("Nope", 0, TEXT)


def test_quoted_value_reduces_the_selected_cells():
    rows = figures.results_table("Flex", 0, TEXT)
    assert figures.quoted_value(rows, "ratio", {"pattern": "bigbird"}, "min") == 0.77
    assert figures.quoted_value(rows, "ratio", {"pattern": "bigbird"}, "max") == 0.84
    assert figures.quoted_value(rows, "ratio", {}, "max") == 0.90
    with pytest.raises(ValueError, match="'all' of"):
        figures.quoted_value(rows, "ratio", {"pattern": "bigbird"}, "all")
    with pytest.raises(ValueError, match="no number"):
        figures.quoted_value(rows, "ratio", {"pattern": "causal"}, "min")


def test_a_quote_that_drifts_from_the_table_is_reported(tmp_path, monkeypatch):
    (tmp_path / "doc.md").write_text("BigBird is 0.07x FlexAttention.\n")
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    quote = figures.Quote(
        "q",
        figures.Site("doc.md", "BigBird is {lo}x FlexAttention."),
        "Flex",
        {"lo": ("ratio", {"pattern": "bigbird"}, "min")},
    )
    (line,) = figures.check_quotes((quote,), TEXT)
    assert line.startswith("NO q {lo}: doc.md says 0.07") and line.endswith("gives 0.77")
    (tmp_path / "doc.md").write_text("BigBird is 0.77x FlexAttention.\n")
    assert figures.check_quotes((quote,), TEXT)[0].startswith("yes q {lo}")


def test_every_quote_in_the_docs_agrees_with_results_md():
    lines = figures.check_quotes()
    assert lines and all(line.startswith("yes") for line in lines), "\n".join(lines)
