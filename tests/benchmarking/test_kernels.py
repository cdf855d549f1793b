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
