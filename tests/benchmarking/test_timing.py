"""Subprocess measurement reports results and failures."""

from attnkit.benchmarking import timing


def test_in_subprocess_returns_the_workers_result():
    result = timing.in_subprocess({"kind": "sdpa-torch", "n": 8, "repeats": 1})
    assert result["seconds"] > 0 and result["peak_bytes"] > 0


def test_in_subprocess_reports_failure():
    result = timing.in_subprocess({"kind": "nope", "n": 8})
    assert "error" in result and "unknown benchmark kind" in result["error"]


def test_machine_names_torch():
    assert "torch" in timing.machine()
