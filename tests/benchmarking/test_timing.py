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


def test_measure_step_counts_the_repeats_after_a_warm_up():
    calls = []
    result = timing.measure_step(lambda: calls.append(1), repeats=4)
    assert len(calls) == 5  # one warm-up, four timed
    assert result["seconds"] >= 0 and result["peak_bytes"] >= result["base_bytes"] > 0


def test_in_subprocess_reports_a_timeout_and_runs_another_module():
    slow = timing.in_subprocess({"kind": "sdpa-torch", "n": 8}, timeout=0.001)
    assert slow == {"error": "over the 0 s limit"}
    case = {"way": "unmasked", "n": 16, "d": 4}
    result = timing.in_subprocess(case, module="attnkit.benchmarking.sparse")
    assert result["density"] == 1.0 and result["seconds"] > 0


def test_interleaved_runs_every_call_each_round_each_first_in_turn():
    ran: list[str] = []
    calls = {name: (lambda name=name: ran.append(name)) for name in ("a", "b", "c")}
    times = timing.interleaved(calls, 4)
    assert ran == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
