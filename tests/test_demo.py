"""The demo runs and prints one row per variant."""

import attnkit as ak
from attnkit import demo


def test_demo_prints_every_variant(capsys):
    demo.main()
    out = capsys.readouterr().out
    for name in demo.variants(8):
        assert name in out
    assert "MultiHeadAttention" in out


def test_table_marks_support_and_entropy():
    import torch

    text = demo.table(
        {"a": (torch.tensor([0.5, 0.5, 0.0]), True), "b": (torch.tensor([0.9, 0.2, 0.1]), False)}
    )
    row_a = next(line for line in text.splitlines() if line.startswith("a"))
    assert row_a.split("|")[2].strip() == "2"
    assert abs(float(row_a.split("|")[3]) - 0.693) < 1e-3
    row_b = next(line for line in text.splitlines() if line.startswith("b"))
    assert row_b.split("|")[3].strip() == "-"
    assert ak.attention  # the package imports
