"""The core benchmark's paired ratios: structure only (timings belong to benchmarks/RESULTS.md)."""

import pytest

from attnkit.benchmarking import core


def test_paired_ratios_lists_each_score_and_the_base():
    table = core.paired_ratios(1, 8, 8, 2, ["additive", "general"], repeats=3)
    lines = table.splitlines()
    assert lines[0] == "### Scores relative to scaled_dot: paired rounds"
    assert "3 rounds; load average after each round" in lines[2]
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert set(rows) >= {"additive", "general", "scaled_dot"}
    for name in ("additive", "general"):
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        per_round = [float(r) for r in cells[3].split(", ")]
        assert len(per_round) == 3 and all(r > 0 for r in per_round)
        assert min(per_round) <= float(cells[2]) <= max(per_round)


def test_paired_ratios_refuses_no_rounds():
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        core.paired_ratios(1, 8, 8, 2, ["additive"], repeats=0)
