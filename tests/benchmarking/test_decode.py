"""The decoding benchmark's tables: structure only (timings belong to benchmarks/RESULTS.md)."""

from attnkit.benchmarking import decode


def test_quick_tables_have_every_row_and_consistent_ratios():
    seen = []
    text, cross = decode.main(quick=True, progress=seen.append).split(
        "### Encoder–decoder: cross-attention memory cache"
    )
    lines = text.splitlines()
    assert lines[0] == "### Decoding: KV cache vs recomputation"
    s = decode.sizes(True)
    rows = [
        line.strip("|").split("|") for line in lines if line.startswith("| ") and "---" not in line
    ]
    speed = [r for r in rows if r[0].strip().isdigit()]
    assert [int(r[0]) for r in speed] == list(s.contexts)
    for r in speed:
        fast, slow, ratio = (float(x) for x in r[1:4])
        assert fast > 0 and slow > 0 and abs(ratio - fast / slow) <= 0.05 * ratio + 0.1
    sizes = [r for r in rows if "MHA" in r[0] or "query" in r[0]]
    kv = [int(r[0].split()[0]) for r in sizes]
    assert kv == [s.heads, s.heads // 4, 1]
    ratios = [float(r[2]) for r in sizes]
    # The cache holds H_kv heads: its size is proportional to the number of key/value heads.
    assert ratios == [round(k / s.heads, 3) for k in kv]
    assert seen
    rows = [line.strip("|").split("|") for line in cross.splitlines() if line.startswith("| ")]
    rows = [r for r in rows if r[0].strip().isdigit()]
    assert [int(r[0]) for r in rows] == list(s.contexts)
    for r in rows:
        kept, again, ratio = (float(x) for x in r[1:4])
        assert kept > 0 and again > 0 and abs(ratio - kept / again) <= 0.05 * ratio + 0.1
