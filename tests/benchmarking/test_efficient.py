"""The efficient-attention benchmark: slopes, crossover and the table's structure (never a
timing value)."""

import math
import re

import pytest
import torch

from attnkit.benchmarking import efficient as eff


def test_slope_of_a_power_law_is_its_exponent():
    points = [(n, 3.0 * n**1.5) for n in (100, 200, 400, 800)]
    assert eff.slope(points) == pytest.approx(1.5)
    assert eff.slope([(n, 7.0) for n in (10, 20)]) == pytest.approx(0.0)
    assert eff.slope([(10, 1.0)]) is None


def test_crossover_is_where_it_stays_faster():
    exact = eff.Result(
        "exact chunked", {n: {"seconds": t} for n, t in [(1, 1.0), (2, 4.0), (4, 16.0), (8, 64.0)]}
    )
    fast = eff.Result("m", {n: {"seconds": t} for n, t in [(1, 0.5), (2, 5.0), (4, 8.0),
                                                            (8, 16.0)]})  # fmt: skip
    slow = eff.Result("s", {n: {"seconds": 100.0} for n in (1, 2, 4, 8)})
    assert eff.crossover(fast, exact) == 4  # faster at 1, not at 2, from 4 on
    assert eff.crossover(slow, exact) is None


def test_candidates_are_registered_slot_parts_by_name():
    names = eff.candidates()
    assert "linear" in names and "performer" in names


def test_run_case_reports_time_and_memory_in_process():
    out = eff.run_case({"name": "linear", "n": 32, "heads": 2, "d": 8, "repeats": 1})
    assert out["seconds"] > 0 and out["peak_bytes"] >= out["base_bytes"] > 0


def check_table(text: str) -> None:
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| contestant")
    }
    assert set(rows) == {"exact SDPA", "exact chunked", "linear"}
    # the last table: time slope, memory slope, crossover, speed-up, memory ratio, linear
    lines = text.split("| contestant | time slope")[1].splitlines()[2:]
    summary = [line for line in lines if line.startswith("| ")]
    assert len(summary) == 3
    for line in summary:
        cells = [c.strip() for c in line.split("|")[2:-1]]
        assert math.isfinite(float(cells[0])) and math.isfinite(float(cells[1]))
        assert cells[5] in ("yes", "no")
    linear = next(line for line in summary if line.startswith("| linear"))
    cross = linear.split("|")[4].strip()
    assert cross == "never" or re.fullmatch(r"\d+", cross)
    assert re.search(r"\| linear \| [\d.]+ \| [\d.]+ \|", text)  # time per N


def test_quick_table_structure_and_slopes():
    torch.manual_seed(0)
    check_table(eff.main(True, ["linear"], [64, 128], in_process=True))


@pytest.mark.slow
def test_quick_mode_in_fresh_processes(tmp_path):
    png = tmp_path / "efficient.png"
    text = eff.main(True, ["linear"], [64, 128], plot_path=str(png))
    check_table(text)
    assert png.stat().st_size > 0 or "matplotlib not installed" in text


def test_every_candidate_is_built_and_runs_the_synthesizer_included():
    """Every default contestant builds from the sizes alone (the synthesizer with Tay's dense
    synthetic logits), so no cell of ``attnkit bench efficient`` fails for want of arguments."""
    names = eff.candidates()
    assert "synthesizer" in names
    out = eff.run_case({"name": "synthesizer", "n": 16, "heads": 2, "d": 8, "repeats": 1})
    assert "error" not in out and out["seconds"] > 0


def test_table_of_failed_skipped_and_memoryless_cells():
    exact = eff.Result(
        "exact chunked",
        {
            64: {"seconds": 1.0, "peak_bytes": 5, "base_bytes": 5},
            128: {"seconds": 4.0, "peak_bytes": 9, "base_bytes": 5},
        },
    )
    broken = eff.Result(
        "broken", {64: {"error": "ValueError: no"}, 128: {"error": "not run: 64 took over 1 s"}}
    )
    flat = eff.Result(
        "flat",
        {
            64: {"seconds": 0.5, "peak_bytes": 5, "base_bytes": 5},
            128: {"seconds": 1.0, "peak_bytes": 5, "base_bytes": 5},
        },
    )
    text = eff.table([exact, broken, flat], reference=128)  # fmt: skip
    assert "- broken at N=64: ValueError: no" in text
    summary = text.split("| contestant | time slope")[1]
    broken_row = next(line for line in summary.splitlines() if line.startswith("| broken"))
    assert [c.strip() for c in broken_row.split("|")[2:-1]] == ["-", "-", "never", "-", "-", "-"]
    flat_row = next(line for line in summary.splitlines() if line.startswith("| flat"))
    cells = [c.strip() for c in flat_row.split("|")[2:-1]]
    assert cells[:4] == ["1.00", "0.00", "64", f"{4.0 / 1.0:.1f}"]
    assert math.isfinite(float(cells[4]))
