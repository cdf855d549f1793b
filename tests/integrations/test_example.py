"""The fine-tuning examples run as documented (tiny sizes)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_finetune_example_runs():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "finetune_transformers.py"),
            "--align",
            "entmax15",
            "--epochs",
            "1",
            "--n-train",
            "128",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1: loss" in proc.stdout and "test accuracy" in proc.stdout


def test_vit_example_runs():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "finetune_vit.py"),
            "--align",
            "sparsemax",
            "--epochs",
            "1",
            "--n-train",
            "64",
            "--n-test",
            "32",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("epoch 1: loss") and "[CLS] attention on the digit" in line
