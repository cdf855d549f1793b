"""The environment of a run: the command line as typed, the processor named, every field
described, times readable."""

import os
import platform

import pytest
import torch

import attnkit
from attnkit.experiments import environment


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["/opt/env/bin/attnkit", "run", "--task", "copy"], "attnkit run --task copy"),
        (["/x/src/attnkit/__main__.py", "run"], "python -m attnkit run"),
        (["train.py", "--out", "my runs"], "python train.py --out 'my runs'"),
        (["attnkit"], "attnkit"),
        (["-c", "x"], "python -c x"),
        ([], ""),
    ],
)
def test_the_command_line_names_the_program_without_its_directory(argv, line):
    assert environment.command_line(argv) == line


def test_collect_fills_every_field_from_the_running_process():
    env = environment.collect(threads=2, wall_seconds=3.0, train_seconds=2.0, argv=["attnkit"])
    assert list(env) == list(environment.FIELDS)
    assert env["attnkit"] == attnkit.__version__ and env["torch"] == torch.__version__
    assert env["python"] == platform.python_version() and env["os"] == platform.platform()
    assert env["cpu_cores"] == os.cpu_count() and env["threads"] == 2
    assert env["processes"] == 1 and env["device"] == "cpu"
    assert isinstance(env["processor"], str) and env["processor"].strip()


def test_the_processor_comes_from_cpuinfo_first(monkeypatch):
    monkeypatch.setattr(environment, "_cpuinfo_model", lambda: "Some CPU 3000")
    monkeypatch.setattr(environment, "_lscpu_model", lambda: "other")
    assert environment.processor() == "Some CPU 3000"
    monkeypatch.setattr(environment, "_cpuinfo_model", lambda: None)
    assert environment.processor() == "other"
    monkeypatch.setattr(environment, "_lscpu_model", lambda: None)
    monkeypatch.setattr(environment.platform, "processor", lambda: "")
    monkeypatch.setattr(environment.platform, "machine", lambda: "x86_64")
    assert environment.processor() == "x86_64"


def test_rows_follow_the_fields_and_write_times_for_people():
    rows = environment.rows(
        {"extra": 1, "train_seconds": 7230.0, "wall_seconds": 75.0, "command": None}
    )
    assert rows == [
        ["command line", "-"],
        ["wall time of this invocation, training + evaluation", "75 s (1 min 15 s)"],
        ["of which training", "7230 s (2 h 0 min)"],
        ["extra", "1"],
    ]
