"""Runs: files written, reproducible, resume after a kill equals an uninterrupted run, the
--compare table, digits soft and hard."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from attnkit import cli
from attnkit.experiments import checkpoints
from attnkit.experiments.config import RunConfig
from attnkit.experiments.runner import run

TINY = ["--n-train", "256", "--n-test", "64", "--batch-size", "32", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics(d):
    return json.loads((d / "metrics.json").read_text())


def test_a_run_writes_everything_and_is_reproducible(tmp_path):
    cfg = RunConfig(epochs=2, n_train=256, n_test=64, batch_size=32)
    d1, m1 = run(cfg, tmp_path / "a", progress=False)
    for name in (
        "config.json",
        "metrics.json",
        "model.safetensors",
        "optimizer.pt",
        "state.json",
        "report.html",
        "heatmap_0.png",
        "curves.png",
    ):
        assert (d1 / name).exists(), name
    assert "data:image/png;base64," in (d1 / "report.html").read_text()
    assert {"exact_match", "aer_argmax", "uniform_ablation_drop"} <= set(m1)
    _, m2 = run(cfg, tmp_path / "b", progress=False)
    assert m1 == m2


class Killed(BaseException):
    """Stands for the process dying: nothing in the runner catches it."""


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    args = ["run", "dates", "--epochs", "3", *TINY]
    whole = tmp_path / "whole"
    assert cli.main([*args, "--out", str(whole)]) == 0
    save = checkpoints.save
    saved = []

    def save_then_die_after_the_first(*a, **kw):
        if saved:
            raise Killed
        save(*a, **kw)
        saved.append(1)

    monkeypatch.setattr(checkpoints, "save", save_then_die_after_the_first)
    killed = tmp_path / "killed"
    with pytest.raises(Killed):
        cli.main([*args, "--out", str(killed)])
    monkeypatch.setattr(checkpoints, "save", save)
    assert json.loads((killed / "state.json").read_text())["epoch"] == 1
    assert not (killed / "metrics.json").exists()
    assert cli.main(["run", "--resume", str(killed), "--no-progress"]) == 0
    assert _metrics(killed) == _metrics(whole)
    w1, w2 = (
        load_file(str(whole / "model.safetensors")),
        load_file(str(killed / "model.safetensors")),
    )
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k])


def test_compare_prints_one_row_per_variant(tmp_path, capsys):
    argv = [
        "run",
        "dates",
        "--epochs",
        "1",
        *TINY,
        "--compare",
        "score=additive,dot",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| dates |")]
    assert len(rows) == 2 and "| additive |" in rows[0] and "| dot |" in rows[1]


@pytest.mark.parametrize("align", ["softmax", "hard"])
def test_digits_soft_and_hard(tmp_path, align):
    cfg = RunConfig(task="digits", align=align, epochs=1, n_train=256, n_test=64, batch_size=32)
    d, m = run(cfg, tmp_path / align, progress=False)
    assert 0 <= m["accuracy"] <= 1 and 0 <= m["attention_correctness"] <= 1
    assert (d / "report.html").exists()


def test_ddp_two_processes_equal_one(tmp_path):
    args = ["run", "dates", "--epochs", "1", *TINY]
    single = tmp_path / "single"
    assert cli.main([*args, "--out", str(single)]) == 0
    ddp = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "attnkit",
            *args,
            "--out",
            str(ddp),
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
    )
    w1 = load_file(str(single / "model.safetensors"))
    w2 = load_file(str(ddp / "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("task", ["dates", "digits"])
@pytest.mark.slow
def test_quick_variant_runs_end_to_end(task, tmp_path, capsys):
    assert cli.main(["run", task, "--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").exists()
    assert f"| {task} | additive | softmax |" in capsys.readouterr().out
