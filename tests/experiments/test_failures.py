"""Faults of the command line: each ends in one line on stderr and an exit status (2 for the
input or the machine, 1 with a log of the traceback for an internal error), and the run
directory stays resumable."""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit import cli, tasks
from attnkit.experiments import checkpoints
from attnkit.tasks.dates_task import DatesTask

TINY = ["--n-train", "64", "--n-test", "16", "--batch-size", "32", "--d-model", "8"]
TINY += ["--no-progress", "--threads", "1"]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "marked_task.py"


@pytest.fixture
def registry():
    """The task registry put back as it was (a --task-module run registers its task)."""
    table = tasks.REGISTRY.snapshot()
    yield
    tasks.REGISTRY.restore(table)


def _line(capsys, *fragments: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(r"attnkit (run|explain): error: ", err[0]), err[0]
    assert "Traceback" not in err[0]
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    return err[0]


def _no_partial(run_dir: Path) -> None:
    left = list((run_dir / checkpoints.FOLDER).glob(f"{checkpoints.PARTIAL}*"))
    assert left == [], left


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes_to_the_same_result(
    tmp_path, capsys, monkeypatch
):
    """The second epoch's checkpoint meets a full disk (ENOSPC half-way through the weights):
    exit 2 naming the file and how to continue; the first checkpoint is kept and the resumed
    run ends with the metrics of a run that never failed."""
    clean = tmp_path / "clean"
    assert cli.main(["run", "dates", *TINY, "--epochs", "2", "--out", str(clean)]) == 0
    save_file = checkpoints.save_file
    calls = []

    def full_disk(tensors, path):
        calls.append(path)
        if len(calls) == 3:  # the weights of the second checkpoint (each has two safetensors)
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        save_file(tensors, path)

    monkeypatch.setattr(checkpoints, "save_file", full_disk)
    out = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["run", "dates", *TINY, "--epochs", "2", "--out", str(out)]) == 2
    line = _line(capsys, "cannot write", "model.safetensors", "No space left on device")
    assert f"continue with: attnkit run --resume {out}" in line
    assert checkpoints.latest(out).name == "1"
    _no_partial(out)
    assert not (out / "metrics.json").exists()
    monkeypatch.undo()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert "resuming at epoch 2, step 1" in capsys.readouterr().out
    expected = json.loads((clean / "metrics.json").read_text())
    assert json.loads((out / "metrics.json").read_text()) == expected


def test_a_file_size_limit_while_checkpointing_is_one_line_and_the_run_resumes(tmp_path, capsys):
    """A real fault: the run in a process whose files may not pass 8 kB (RLIMIT_FSIZE, SIGXFSZ
    ignored so that the write fails with EFBIG); the first checkpoint's weights pass it."""
    out = tmp_path / "run"
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (8000, resource.RLIM_INFINITY))\n"
        "from attnkit import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    argv = ["run", "dates", *TINY, "--epochs", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("attnkit run: error: cannot write "), line
    assert "File too large" in line and f"attnkit run --resume {out}" in line, line
    assert checkpoints.latest(out) is None
    _no_partial(out)
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert checkpoints.latest(out).name == "1" and (out / "metrics.json").is_file()


def test_an_empty_split_of_the_users_data_is_one_line_and_writes_nothing(tmp_path, capsys):
    data = tmp_path / "texts.jsonl"
    rows = [{"text": f"good film {i}", "label": "pos", "split": "train"} for i in range(40)]
    rows += [{"text": f"bad film {i}", "label": "neg", "split": "train"} for i in range(40)]
    rows += [{"text": "bad plot", "label": "neg", "split": "test"}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "run"
    argv = ["run", "text", "--data", str(data), *TINY, "--epochs", "1", "--out", str(out)]
    assert cli.main(argv) == 2
    _line(capsys, f"data: {data}: the validation split is empty")
    assert not out.exists()


def _task_file(directory: Path, **replace: str) -> Path:
    """The example task in ``directory`` with each ``old=new`` text replaced; one heatmap."""
    text = EXAMPLE.read_text()
    replace = {'(t[:n] for t in self.data["test"])': '(t[:1] for t in self.data["test"])',
               **replace}  # fmt: skip
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = directory / "my_task.py"
    path.write_text(text)
    return path


# a fault past the tiny run of the contract check (4 examples), while the file "broken" exists
BROKEN = 'len(tokens) > 4 and __import__("os").path.exists(__file__[:-10] + "broken")'


def test_a_user_task_that_raises_in_evaluate_is_one_line_with_a_log_and_resumes(
    tmp_path, capsys, registry
):
    rows = "        rows = torch.arange(len(tokens))\n"
    task = _task_file(
        tmp_path, **{rows: rows + f'        if {BROKEN}:\n            raise RuntimeError("boom")\n'}
    )
    (tmp_path / "broken").touch()
    out = tmp_path / "run"
    argv = ["run", "--task-module", f"{task}:MarkedTask", *TINY, "--epochs", "1"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    line = _line(capsys, "task 'marked' raised in evaluate", f"{task}:", "RuntimeError: boom")
    log = Path(re.search(r"traceback in (\S+?);", line).group(1))
    assert "Traceback" in log.read_text() and 'raise RuntimeError("boom")' in log.read_text()
    assert f"continue with: attnkit run --resume {out}" in line
    (tmp_path / "broken").unlink()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "metrics.json").read_text()).keys() == {"accuracy", "gold_weight"}


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_user_task_whose_metric_is_not_finite_is_refused_naming_it(
    tmp_path, capsys, registry, value
):
    old = '"accuracy": float((logits.argmax(-1) == tokens[rows, where]).float().mean()),'
    new = f'"accuracy": float("{value}") if {BROKEN} else 0.5,'
    task = _task_file(tmp_path, **{old: new})
    (tmp_path / "broken").touch()
    out = tmp_path / "run"
    argv = ["run", "--task-module", f"{task}:MarkedTask", *TINY, "--epochs", "1"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    _line(
        capsys,
        "task 'marked': evaluate('validation') at epoch 1 gave metric 'accuracy' = "
        f"{float(value)}, not a finite number",
        f"continue with: attnkit run --resume {out}",
    )
    assert not (out / "metrics.json").exists()
    (tmp_path / "broken").unlink()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert json.loads((out / "metrics.json").read_text())["accuracy"] == 0.5


def test_an_internal_error_exits_1_with_a_log_of_the_traceback(tmp_path, capsys, monkeypatch):
    def broken(self, model, n=4):
        return 1 / 0

    monkeypatch.setattr(DatesTask, "heatmaps", broken)
    out = tmp_path / "run"
    assert cli.main(["run", "dates", *TINY, "--epochs", "1", "--out", str(out)]) == 1
    line = _line(capsys, "internal error", "ZeroDivisionError: division by zero")
    log = Path(re.search(r"traceback in (\S+?);", line).group(1))
    assert "in broken" in log.read_text()


def test_memory_running_out_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    def build_model(self):
        raise RuntimeError("[enforce fail] DefaultCPUAllocator: not enough memory: you tried ...")

    monkeypatch.setattr(DatesTask, "build_model", build_model)
    argv = ["run", "dates", *TINY, "--epochs", "1", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    _line(capsys, "out of memory", "try a smaller --batch-size")
