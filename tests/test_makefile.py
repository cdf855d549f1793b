"""The Makefile's set-up says where torch comes from and takes another index only when asked."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands(tmp_path, *variables: str) -> list[str]:
    """The commands ``make`` would run to set up a new environment in ``tmp_path`` (dry run)."""
    venv = tmp_path / "venv"
    done = subprocess.run(
        [shutil.which("make") or "make", "-n", "-B", f"VENV={venv}", *variables,
         f"{venv}/.installed"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def _torch_lines(lines: list[str]) -> tuple[str, str]:
    said = [line for line in lines if "echo" in line and "Installing torch" in line]
    install = [line for line in lines if "pip install" in line and "torch==2.13.0" in line]
    assert len(said) == 1 and len(install) == 1, lines
    return said[0], install[0]


def test_by_default_torch_comes_from_pips_index_and_the_message_says_so(tmp_path):
    said, install = _torch_lines(_setup_commands(tmp_path))
    assert "--index-url" not in install  # works offline with a local wheel or cache
    assert "(the CPU build)" not in said  # what pip takes from PyPI on Linux is not
    assert "from pip's configured index" in said and "CUDA" in said
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in said


def test_torch_index_takes_torch_from_the_index_asked_for(tmp_path):
    index = "https://download.pytorch.org/whl/cpu"
    said, install = _torch_lines(_setup_commands(tmp_path, f"TORCH_INDEX={index}"))
    assert f"--index-url {index} torch==2.13.0" in install
    assert f"Installing torch 2.13.0 from {index}" in said
