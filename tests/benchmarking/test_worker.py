"""Every benchmark case builds and runs at a tiny size."""

import pytest

from attnkit.benchmarking import worker

CASES = [
    {"kind": "additive-dense", "n": 16},
    {"kind": "additive-chunked", "n": 16, "chunk": 4},
    {"kind": "sparse-package", "n": 16, "align": "sparsemax"},
    {"kind": "sparse-chunked", "n": 16, "align": "entmax15", "chunk": 4},
    {"kind": "sdpa-attnkit", "n": 16, "b": 2, "heads": 2},
    {"kind": "sdpa-torch", "n": 16, "b": 2, "heads": 2},
]


@pytest.mark.parametrize("case", CASES, ids=[c["kind"] for c in CASES])
def test_case_runs(case):
    result = worker.run({**case, "repeats": 1})
    assert result["seconds"] > 0
    assert result["peak_bytes"] >= result["base_bytes"] > 0


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown benchmark kind"):
        worker.build({"kind": "nope", "n": 4})
