"""The kernel benchmark's tables: structure only (timings belong to benchmarks/RESULTS.md)."""

from attnkit.benchmarking import kernels


def test_tanh_table_lists_the_limit_and_each_kernel():
    seen = []
    table = kernels.tanh_table(64, seen.append, compile_tile=False)
    lines = table.splitlines()
    assert lines[0].startswith("### The limit of additive attention")
    assert "G tanh/s (the machine's rate)" in lines[2]
    rows = [line for line in lines if line.startswith("| additive")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| additive chunked, eager tile",
        "| additive dense broadcast",
    ]
    for row in rows:
        rate, fraction = (float(x) for x in row.strip("| ").split(" | ")[1:])
        assert rate > 0 and fraction > 0
    assert seen  # progress was reported


MiB = 1 << 20


def _cell(seconds: float, peak_mib: float, base_mib: float = 100.0) -> dict:
    return {"seconds": seconds, "peak_bytes": peak_mib * MiB, "base_bytes": base_mib * MiB}


def _fake(cells: dict):
    """A stand-in for the fresh-process worker: a canned result per case kind."""

    def in_subprocess(case: dict) -> dict:
        return dict(cells[case["kind"]])

    return in_subprocess


def _row(table: str, first: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {first} |"))
    return [c.strip() for c in line.split("|")[1:-1]]


def test_above_base_when_the_baseline_adds_no_memory(monkeypatch):
    """The peak is a high-water mark: a baseline that fits in what the process already held
    adds nothing, and the table says so instead of dividing by zero."""
    cells = {
        "additive-chunked": _cell(0.5, 160.0),
        "additive-dense": _cell(1.0, 100.0),  # peak == base
        "sparse-chunked": _cell(0.2, 130.0),
        "sparse-package": _cell(0.4, 90.0),  # below base: nothing added either
    }
    monkeypatch.setattr(kernels, "in_subprocess", _fake(cells))
    row = _row(kernels.additive_table([64], 64, lambda msg: None), "64")
    assert row[3] == f"{0.5 / 1.0:.3f}" and row[7] == f"{160 / 100:.3f}"
    assert row[8] == "n/a (baseline added no memory)"
    for name in ("sparsemax", "entmax15"):
        row = _row(kernels.sparse_table(64, lambda msg: None), name)
        assert row[3] == f"{0.2 / 0.4:.3f}" and row[7] == "n/a (baseline added no memory)"


def test_above_base_and_ratios_of_measured_cells(monkeypatch):
    cells = {"additive-chunked": _cell(0.3, 130.0), "additive-dense": _cell(0.6, 220.0)}
    monkeypatch.setattr(kernels, "in_subprocess", _fake(cells))
    row = _row(kernels.additive_table([64], 64, lambda msg: None), "64")
    assert row[1:4] == ["600", "300", f"{0.3 / 0.6:.3f}"]
    assert row[8] == f"{(130 - 100) / (220 - 100):.3f}"


def test_failed_skipped_and_zero_time_cells_are_not_divided(monkeypatch):
    cells = {
        "additive-chunked": {"error": "killed"},
        "sdpa-attnkit": _cell(0.1, 120.0),
        "sdpa-torch": _cell(0.0, 120.0),  # a timer too coarse for the call
    }
    monkeypatch.setattr(kernels, "in_subprocess", _fake(cells))
    row = _row(kernels.additive_table([64], 32, lambda msg: None), "64")  # dense not run
    assert row[1:4] == ["-", "-", "-"] and row[4].startswith("not run: needs about")
    assert row[7] == row[8] == "-"
    table = kernels.sdpa_table(1, 1, 16, lambda msg: None)
    assert table.splitlines()[-1].split("|")[3].strip() == "n/a"


def test_additive_paired_reports_a_ratio_per_round(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # no compilation cost
    table = kernels.additive_paired(32, repeats=2, d_w=8)
    lines = table.splitlines()
    assert lines[0] == "### Additive attention, chunked/dense in alternation (N=32)"
    assert "load average after each round" in lines[2]
    dense, chunked, ratio, rounds = (c.strip() for c in lines[-1].split("|")[1:-1])
    per_round = [float(r) for r in rounds.split(", ")]
    assert len(per_round) == 2 and all(r > 0 for r in per_round)
    assert min(per_round) <= float(ratio) <= max(per_round)
    assert float(dense) >= 0 and float(chunked) >= 0
