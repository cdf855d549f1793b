"""The block-sparse benchmark: densities, the table's structure and the CLI (never a timing
value)."""

import re
import subprocess
import sys

import pytest

from attnkit import patterns as pt
from attnkit.benchmarking import sparse


@pytest.mark.parametrize("way", ["block-sparse", "dense-tile", "unmasked"])
def test_run_case_reports_time_memory_and_density(way):
    case = {"way": way, "n": 1000, "d": 8, "pattern": "window 256"}
    out = sparse.run_case(case)
    assert out["seconds"] > 0 and out["peak_bytes"] >= out["base_bytes"] > 0
    if way == "block-sparse":
        bm = pt.block_mask(pt.sliding_window(256), 1000, block_q=128, block_k=128)
        assert out["density"] == pytest.approx(bm.density) and out["density"] < 1
    else:
        assert out["density"] == 1.0


def test_unknown_way_and_pattern_are_refused():
    with pytest.raises(ValueError, match="unknown way"):
        sparse.run_case({"way": "diagonal", "n": 16})
    with pytest.raises(ValueError, match="unknown pattern"):
        sparse.run_case({"way": "block-sparse", "n": 16, "pattern": "spiral"})


def rows(text: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| pattern")
    ]


def test_table_has_every_pattern_at_every_size_and_skips_big_dense_tiles():
    text = sparse.main(True, sizes=[256, 512], dense_tile_up_to=256, in_process=True)
    table = rows(text)
    assert [(r[0], int(r[1])) for r in table] == [
        (sparse.DESCRIPTION[p], n) for n in (256, 512) for p in sparse.PATTERNS
    ]
    for r in table:
        density = float(r[2])
        assert 0 < density <= 1
        assert float(r[6]) > 0  # the ratio
        assert re.fullmatch(r"\d+ / (\d+|-)", r[7])
        assert (r[4] == "not run (N × N mask)") == (int(r[1]) > 256)


@pytest.mark.slow
def test_fresh_processes_and_the_cli_choice(monkeypatch):
    monkeypatch.setattr(sparse, "sizes_for", lambda quick: [256])
    text = sparse.main(True)
    assert len(rows(text)) == len(sparse.PATTERNS)
    help_text = subprocess.run(
        [sys.executable, "-m", "attnkit", "bench", "--help"], capture_output=True, text=True
    ).stdout
    assert "sparse" in help_text


def test_table_when_the_expected_time_is_zero(monkeypatch):
    """A zero density (or an unmeasurably fast unmasked call) leaves no ratio: n/a, no
    division by zero."""

    def fake(case):
        return {"seconds": 0.0 if case["way"] == "unmasked" else 0.5, "density": 1.0,
                "peak_bytes": 3 * (1 << 20), "base_bytes": 1 << 20}  # fmt: skip

    monkeypatch.setattr(sparse, "run_case", fake)
    table = rows(sparse.main(True, sizes=[256], in_process=True))
    assert len(table) == len(sparse.PATTERNS)
    assert all(r[6] == "n/a" and r[7] == "2 / 2" for r in table)
