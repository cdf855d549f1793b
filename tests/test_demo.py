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


def test_make_demo_is_quick_and_says_what_to_run_next():
    """The Makefile's demo recipe: the quick run (not the full training), then the way to
    reach the attnkit command."""
    from pathlib import Path

    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    lines = makefile.read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0].splitlines()
    commands = [line.strip() for line in lines[1:]]
    assert "$(PY) -m attnkit run dates --quick" in commands
    assert not any(c.endswith("attnkit run dates") for c in commands)
    said = " ".join(c for c in commands if c.startswith("@echo"))
    assert ".venv/bin/attnkit" in said and "source .venv/bin/activate" in said
