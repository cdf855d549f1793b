"""``attnkit run`` on the command line: every refusal is one line and exit 2, a diverged run
exits 1, Ctrl-C exits 130 with the resume command; --resume, --out and --compare."""

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from attnkit import cli, tasks
from attnkit.experiments import checkpoints
from attnkit.tasks.dates_task import DatesTask

TINY = ["--n-train", "64", "--n-test", "16", "--batch-size", "32", "--d-model", "8"]
TINY += ["--epochs", "1", "--no-progress", "--threads", "1"]


def _one_error_line(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(("attnkit run: error:", "attnkit: error:")), err[0]
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    return err[0]


BAD = [
    (["run", "nosuchtask"], "unknown task 'nosuchtask'"),
    (["run", "dates", "--score", "additve"], "did you mean 'additive'"),
    (["run", "dates", "--align", "softmx"], "did you mean 'softmax'"),
    (["run", "dates", "--epochs", "0"], "epochs must be a positive int"),
    (["run", "dates", "--batch-size", "100", "--n-train", "50"], "no training step would run"),
    (["run", "dates", "--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["run", "dates", "--supervise-attention", "nan"], "supervise_attention must be a finite"),
    (["run", "dates", "--seed", str(2**64)], "seed must be an int in [0, 2**32)"),
    (["run", "listops", "--supervise-attention", "1"], "needs gold alignments"),
    (["run", "dates", "--compare", "depth=1,2"], "unknown key 'depth'"),
    (["run", "dates", "--compare", "score"], "--compare must be KEY=V1,V2"),
    (["run", "dates", "--compare", "score=dot,nope"], "unknown score 'nope'"),
    (["run", "dates", "--score", "dot", "--compare", "score=dot,general"], "both set score"),
    (["run", "dates", "--compare", "seed=1,2,1"], "lists '1' twice"),
    (["run", "dates", "--threads", "0"], "--threads must be a positive int"),
    (["run", "dates", "--seed", "abc"], "invalid int value: 'abc'"),
    (["run", "dates", "--epochz", "3"], "--epochz 3; did you mean --epochs?"),
    # a flag the configured model would ignore is refused, naming both flags
    (["run", "kv-recall", "--attention", "performer", "--score", "additive"],
     "--score additive contradicts --attention performer"),
    (["run", "kv-recall", "--attention", "linear", "--align", "sparsemax"],
     "--align sparsemax contradicts --attention linear"),
    (["run", "kv-recall", "--compare", "attention=full,performer", "--score", "dot"],
     "--score dot contradicts --attention performer"),
    (["run", "babi", "--attention", "memory_network", "--align", "hard"],
     "--align hard contradicts --attention memory_network"),
    (["run", "copy", "--score", "dot"], "--score dot contradicts task 'copy'"),
    (["run", "dates", "--align", "hard", "--supervise-attention", "1"],
     "--supervise-attention 1.0 contradicts --align hard: alignment 'hard' samples"),
    # context parallelism: the task, the length, the world
    (["run", "dates", "--context-parallel", "2"], "task 'dates' cannot split its sequences"),
    (["run", "kv-recall", "--seq-len", "9", "--context-parallel", "2"],
     "seq_len 9 does not split into 2 equal parts"),
    (["run", "kv-recall", "--seq-len", "8", "--context-parallel", "2"],
     "context_parallel 2 does not divide the 1 process"),
    (["run", "kv-recall", "--timeout", "0"], "--timeout must be a number of seconds > 0"),
]  # fmt: skip


def _main(argv):
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's own refusals
        return exc.code


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_refused_command_is_one_line_and_exit_2_and_writes_nothing(
    argv, message, tmp_path, capsys
):
    out = tmp_path / "run"
    assert _main([*argv, "--out", str(out)]) == 2
    _one_error_line(capsys, message)
    assert not out.exists()


def test_unwritable_output_dir_is_refused_cleanly(capsys):
    assert cli.main(["run", "dates", *TINY, "--out", "/proc/nope"]) == 2
    _one_error_line(capsys, "/proc/nope")


def test_an_existing_non_empty_output_dir_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["run", "dates", *TINY, "--out", str(tmp_path)]) == 2
    _one_error_line(capsys, "is not empty", "--resume")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.fixture
def finished(tmp_path):
    out = tmp_path / "done"
    assert cli.main(["run", "dates", *TINY, "--out", str(out)]) == 0
    return out


def test_a_mechanism_with_its_own_weights_records_no_score_or_alignment(
    tmp_path, capsys, monkeypatch
):
    """kv-recall with performer: config.json, the run line, the report and the run directory
    name say what ran, never a score or alignment it did not use."""
    argv = ["run", "kv-recall", "--attention", "performer", "--seq-len", "4", *TINY]
    argv += ["--n-train", "32"]
    monkeypatch.chdir(tmp_path)  # the default run directory is under ./runs
    assert cli.main(argv) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("kv-recall-performer-s0-")
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["attention"] == "performer" and saved["score"] is None and saved["align"] is None
    first = capsys.readouterr().out.splitlines()[0]
    assert "attention performer, 1 epoch of 1 step (n_train 32" in first, first
    assert "score" not in first and "align" not in first
    page = (run_dir / "report.html").read_text()
    assert page.count("not used by this model") == 2 and "scaled_dot" not in page
    assert cli.main(["run", "--resume", str(run_dir), "--no-progress"]) == 0  # still resumable
    assert cli.main(["run", "--resume", str(run_dir), "--score", "dot"]) == 2
    _one_error_line(capsys, "score = 'dot' contradicts its score = unset (not used")


def test_no_task_prints_the_help_and_exits_2_without_running(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: attnkit run")
    for name in ("dates", "kv-recall", "--resume"):
        assert name in err
    assert err.strip().splitlines()[-1].startswith("attnkit run: error: a task is required")
    assert list(tmp_path.iterdir()) == []


def test_a_finished_run_is_not_overwritten_by_a_new_one(finished, capsys):
    before = (finished / "metrics.json").read_text()
    capsys.readouterr()
    assert cli.main(["run", "dates", *TINY, "--seed", "1", "--out", str(finished)]) == 2
    _one_error_line(capsys, "is not empty")
    assert (finished / "metrics.json").read_text() == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--epochs", "5"], "epochs = 5 contradicts its epochs = 1"),
        (["--align", "sparsemax"], "align = 'sparsemax' contradicts its align = 'softmax'"),
        (["--compare", "score=dot,general"], "--compare cannot be combined with --resume"),
        (["--out", "elsewhere"], "--out cannot be combined with --resume"),
        (["digits"], "task = 'digits' contradicts its task = 'dates'"),
    ],
)
def test_resume_refuses_contradicting_flags(finished, capsys, flags, message):
    before = (finished / "metrics.json").read_text()
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(finished), *flags]) == 2
    _one_error_line(capsys, message)
    assert (finished / "metrics.json").read_text() == before


def test_resume_accepts_flags_that_agree_with_the_run(finished, capsys):
    argv = ["run", "dates", "--resume", str(finished), "--epochs", "1", "--no-progress"]
    assert cli.main(argv) == 0
    assert "all 1 epoch is trained: evaluating" in capsys.readouterr().out


DAMAGE = [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100]), "checksum"),
    ("optimizer.pt", lambda p: p.unlink(), "file missing"),
    ("rng.safetensors", lambda p: p.unlink(), "file missing"),
    ("rng.safetensors", lambda p: p.write_bytes(os.urandom(64)), "checksum"),
    ("state.json", lambda p: p.write_text("{"), "not valid JSON"),
    ("state.json", lambda p: _edit_state(p, epoch=99), "saved position differs from the checksum"),
    ("state.json", lambda p: _edit_state(p, epoch="one", rehash=True),
     "the saved position must be"),
    ("state.json", lambda p: _edit_state(p, epoch=99, history=[{}] * 99, rehash=True),
     "(epoch 99, step 0, 99 epochs of history) is not one of this run (1 epoch of 2 steps)"),
    ("config.json", lambda p: _edit_config(p, lr=0.5),
     "differs from the configuration the checkpoint"),
]  # fmt: skip


def _edit_state(path, rehash=False, **changes):
    """Change the saved position; with ``rehash``, write its checksum anew (as a deliberate
    edit would), so that only the check of the position against the run can refuse it."""
    import hashlib

    data = json.loads(path.read_text())
    data["state"].update(changes)
    if rehash:
        text = json.dumps(data["state"], sort_keys=True, separators=(",", ":"))
        data["state_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    path.write_text(json.dumps(data))


def _edit_config(path, **changes):
    """Edit a run's config.json to other valid values (the path given is a checkpoint file's)."""
    config = path.parent.parent.parent / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


@pytest.mark.parametrize(("name", "damage", "message"), DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(finished, capsys, name, damage, message):
    path = checkpoints.latest(finished) / name
    damage(path)
    named = finished / "config.json" if name == "config.json" else path
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(finished), "--no-progress"]) == 2
    _one_error_line(capsys, str(named), message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (lambda d: {**d, "quick": "no"}, "quick must be bool, got str 'no'"),
        (lambda d: {**d, "colour": "red"}, "unknown key 'colour'"),
    ],
)
def test_a_damaged_config_is_one_line_naming_the_file(finished, capsys, text, message):
    data = json.loads((finished / "config.json").read_text())
    (finished / "config.json").write_text(json.dumps(text(data)))
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(finished)]) == 2
    _one_error_line(capsys, str(finished / "config.json"), message)


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    _one_error_line(capsys, "not a run directory")
    (tmp_path / "score-dot").mkdir()
    (tmp_path / "score-dot" / "config.json").write_text("{}")
    assert cli.main(["run", "--resume", str(tmp_path)]) == 2
    _one_error_line(capsys, f"resume one by one, e.g. {str(tmp_path / 'score-dot')!r}")


def test_a_diverged_run_exits_1_with_one_line(tmp_path, capsys, monkeypatch):
    loss = DatesTask.loss
    monkeypatch.setattr(DatesTask, "loss", lambda *a: loss(*a) * float("nan"))
    assert cli.main(["run", "dates", *TINY, "--out", str(tmp_path / "r")]) == 1
    _one_error_line(capsys, "training diverged: the loss is nan at epoch 1, step 1")


def test_ctrl_c_exits_130_and_prints_the_resume_command(tmp_path, capsys, monkeypatch):
    loss = DatesTask.loss

    def interrupted(*a):
        os.kill(os.getpid(), signal.SIGINT)
        return loss(*a)

    monkeypatch.setattr(DatesTask, "loss", interrupted)
    out = tmp_path / "r"
    assert cli.main(["run", "dates", *TINY, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"continue with: attnkit run --resume {out}" in err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert (out / "metrics.json").exists()


def test_compare_over_any_key_writes_a_combined_table(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert cli.main(["run", "dates", *TINY, "--compare", "lr=0.01,0.001", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| 0.0")]
    assert [row.split("|")[1].strip() for row in rows] == ["0.01", "0.001"]
    assert "exact_match (higher is better)" in printed
    for value in ("0.01", "0.001"):
        saved = json.loads((out / f"lr-{value}" / "config.json").read_text())
        assert saved["lr"] == float(value)
    assert (out / "compare.md").read_text().strip() in printed
    page = (out / "compare.html").read_text()
    assert "lr-0.01/report.html" in page and "higher is better" in page
    assert "red boxes mark the gold alignment" in page  # dates has gold attention
    w = [
        torch.load(checkpoints.latest(out / f"lr-{v}") / "optimizer.pt")["param_groups"][0]["lr"]
        for v in ("0.01", "0.001")
    ]
    assert w == [0.01, 0.001]


def _help(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_is_short_and_names_every_flag_and_task(monkeypatch, capsys):
    from attnkit import tasks

    text = _help(["run", "--help"], monkeypatch, capsys)
    assert len(text.splitlines()) <= 64  # a screenful: no per-task defaults here
    flat = re.sub(r"-\s+", "-", " ".join(text.split()))  # argparse wraps at hyphens
    for name in tasks.available():
        assert name in flat
    for flag in ("--epochs", "--lr", "--pretrained", "--data", "--compare", "--set", "--resume"):
        assert f"\n  {flag} " in text, flag
    assert "attnkit run TASK --help" in flat


@pytest.mark.parametrize("task", tasks.available())
def test_help_after_a_task_lists_its_defaults_names_metrics_and_settings(task, monkeypatch, capsys):
    import attnkit as ak
    from attnkit import tasks

    cls = tasks.get(task)
    text = " ".join(_help(["run", task, "--help"], monkeypatch, capsys).split())
    defaults = text.split("defaults: ", 1)[1].split(" takes:")[0].split(" --")[0]
    for key in ("epochs", "batch_size", "lr", "n_train", "n_test"):
        full, quick = cls.defaults["full"][key], cls.defaults["quick"][key]
        expected = f"{key} {full}" + ("" if quick == full else f" (quick {quick})")
        assert f"{expected}," in defaults, (expected, defaults)
    for name in [*ak.alignments.available(), *ak.scores.available(), *cls.attentions]:
        assert name in text
    for metric in cls.metrics:
        assert f"{metric}: {cls.metrics[metric].description}" in text
    for line in cls.settings_help():
        assert line in text
    if task == "text":
        assert "defaults with --pretrained: epochs 3 (quick 1)" in text
        assert "lr 5e-05 (quick 0.0001)" in text and "d_model 64 (quick 32)" in text
        assert "min_count = 2" in text


def test_config_file_sets_keys_and_flags_override_it(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('task = "dates"\nn_train = 64\nn_test = 16\nbatch_size = 32\nd_model = 8\n'
                    'epochs = 1\nlr = 0.002\nseed = 3\n', encoding="utf-8")  # fmt: skip
    out = tmp_path / "run"
    argv = ["run", "--config", str(toml), "--seed", "5", "--out", str(out)]
    assert cli.main([*argv, "--no-progress", "--threads", "1"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["lr"] == 0.002 and saved["seed"] == 5 and saved["n_train"] == 64
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"task": "dates", **{k: saved[k] for k in ("lr", "seed")}}))
    from attnkit.experiments.config import RunConfig

    assert RunConfig.from_file(as_json) == {"task": "dates", "lr": 0.002, "seed": 5}


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ('task = "dates"\ndepth = 3\n', ".toml", "unknown key 'depth'"),
        ('task = "dates"\nepochs = "3"\n', ".toml", "epochs must be int or null, got str '3'"),
        ("task = [", ".toml", "not valid TOML"),
        ('{"task": "dates", "lr": }', ".json", "not valid JSON"),
        ("n_train = 64\n", ".toml", "names no task"),
        ("task: dates", ".yaml", "must end in .toml or .json"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_file(tmp_path, capsys, content, suffix, message):
    path = tmp_path / f"run{suffix}"
    path.write_text(content, encoding="utf-8")
    assert cli.main(["run", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, message)
    assert not (tmp_path / "out").exists()


def test_text_task_runs_on_the_users_file_and_data_is_refused_elsewhere(tmp_path, capsys):
    from attnkit.tasks.text_task import TextTask

    data = TextTask.example_settings(tmp_path)["data"]
    out = tmp_path / "text"
    argv = ["run", "text", "--data", data, "--out", str(out), "--n-train", "64", "--n-test", "16"]
    assert cli.main([*argv, "--epochs", "1", "--no-progress", "--threads", "1"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == set(TextTask.metrics)
    assert json.loads((out / "config.json").read_text())["data"] == data
    capsys.readouterr()
    assert cli.main(["run", "dates", "--data", data, "--out", str(tmp_path / "d")]) == 2
    _one_error_line(capsys, "task 'dates' reads no data file", "text")
    assert cli.main(["run", "text", "--out", str(tmp_path / "t")]) == 2
    _one_error_line(capsys, "needs --data FILE")


# --compare over several keys and seeds; a task of one's own (--task-module)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "marked_task.py"


@pytest.fixture
def registry():
    """The task registry put back as it was (a --task-module run registers its task)."""
    from attnkit import tasks

    table = tasks.REGISTRY.snapshot()
    yield table
    tasks.REGISTRY.restore(table)


def _task_file(directory, **replace):
    """The example task in ``directory``, one heatmap per run (each costs a PNG)."""
    replace = {'(t[:n] for t in self.data["test"])': '(t[:1] for t in self.data["test"])',
               **replace}  # fmt: skip
    text = EXAMPLE.read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    path = directory / "my_task.py"
    path.write_text(text)
    return path


GRID_BAD = [
    (["--compare", "lr=0.1,0.2", "--compare", "lr=0.3"], "--compare lr=... is given twice"),
    (["--lr", "0.1", "--compare", "seed=0,1", "--compare", "lr=0.2,0.3"], "both set lr"),
    (["--compare", "lr=0.1,0.10"], "lists '0.1' and '0.10', the same value"),
    (["--compare", "lr=0.1,"], "has an empty value"),
    (["--compare", "score=dot,general", "--compare", "align=softmax,softmx"],
     "did you mean 'softmax'"),
    (["--compare", "seed=0,1", "--compare", "supervise_attention=0,-1"],
     "supervise_attention must be a finite number >= 0"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), GRID_BAD, ids=[m for _, m in GRID_BAD])
def test_a_refused_grid_is_one_line_and_exit_2_before_any_run(flags, message, tmp_path, capsys):
    out = tmp_path / "grid"
    assert _main(["run", "dates", *TINY, *flags, "--out", str(out)]) == 2
    _one_error_line(capsys, message)
    assert not out.exists()


def test_a_compared_key_also_in_the_config_file_is_refused(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('task = "dates"\nlr = 0.01\n', encoding="utf-8")
    argv = ["run", "--config", str(toml), "--compare", "lr=0.1,0.2", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    _one_error_line(capsys, f"--compare lr=... and --config {str(toml)!r} both set lr")


def test_a_grid_over_lr_and_seeds_of_a_task_module(tmp_path, capsys, registry):
    import numpy as np

    task = _task_file(tmp_path)
    out = tmp_path / "grid"
    argv = ["run", "--task-module", f"{task}:MarkedTask", *TINY, "--epochs", "2", "--out",
            str(out), "--compare", "lr=0.01,0.03", "--compare", "seed=0,1"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "passed the task contract checks, for each of the 4 runs" in printed
    runs = {(lr, seed): out / f"lr-{lr}_seed-{seed}" for lr in ("0.01", "0.03") for seed in "01"}
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(
        d.name for d in runs.values()
    )
    metrics = {}
    for (lr, seed), run_dir in runs.items():
        saved = json.loads((run_dir / "config.json").read_text())
        assert (saved["lr"], saved["seed"], saved["task"]) == (float(lr), int(seed), "marked")
        assert saved["task_module"] == f"{task}:MarkedTask=marked"
        assert len((run_dir / "epochs.csv").read_text().splitlines()) == 1 + 2
        metrics[lr, seed] = json.loads((run_dir / "metrics.json").read_text())
    table = (out / "compare.md").read_text()
    assert table.strip() in printed
    for lr in ("0.01", "0.03"):
        acc = np.array([metrics[lr, s]["accuracy"] for s in "01"])
        row = f"| {lr} | 2 | {acc.mean():.3f} ± {acc.std(ddof=1):.3f} |"
        assert row in table, (row, table)
    assert f"| 0.03 | 1 | {metrics['0.03', '1']['accuracy']:.3f} |" in table  # per-run rows
    page = (out / "compare.html").read_text()
    import base64

    for run_dir in runs.values():
        assert base64.b64encode((run_dir / "heatmap_0.png").read_bytes()).decode() in page
    assert (out / "compare_curves.png").is_file()


def test_a_task_module_run_is_resumed_and_reloaded_from_another_directory(
    tmp_path, monkeypatch, capsys, registry
):
    import attnkit as ak
    from attnkit import tasks

    (tmp_path / "work").mkdir()
    _task_file(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    out = tmp_path / "run"
    argv = ["run", "--task-module", "my_task.py:MarkedTask", *TINY, "--out", str(out)]
    assert cli.main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    spec = f"{tmp_path / 'work' / 'my_task.py'}:MarkedTask=marked"
    assert (saved["task"], saved["task_module"]) == ("marked", spec)
    monkeypatch.chdir(tmp_path)
    tasks.REGISTRY.restore(registry)  # as in a new process: no task 'marked' registered
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert "all 1 epoch is trained: evaluating" in capsys.readouterr().out
    tasks.REGISTRY.restore(registry)
    loaded = ak.load_run(out)
    expected = json.loads((out / "metrics.json").read_text())
    assert loaded.task.evaluate(loaded.model, "test") == pytest.approx(expected)
    assert cli.main(["run", "--resume", str(out), "--task-module", "x.py:Other"]) == 2
    _one_error_line(capsys, "x.py")


@pytest.mark.parametrize(
    ("replace", "message"),
    [
        ({'    description = "answer': '    description = ""  # "'}, "description must be"),
        ({"return F.cross_entropy(logits, tokens[torch.arange(len(index)), where])":
          "return torch.tensor(1.0)"}, "failed the contract check: loss does not depend"),
        ({}, "registers task 'marked', but the task is 'dates'"),
    ],
)  # fmt: skip
def test_a_task_module_that_breaks_the_contract_is_refused_before_anything_is_written(
    tmp_path, capsys, registry, replace, message
):
    task = _task_file(tmp_path, **replace)
    out = tmp_path / "run"
    named = ["dates"] if not replace else []
    argv = ["run", *named, "--task-module", f"{task}:MarkedTask", *TINY, "--out", str(out)]
    assert cli.main(argv) == 2
    _one_error_line(capsys, message)
    assert not out.exists()


SETTINGS_BAD = [
    (["run", "kv-recall", "--set", "nope=1"], "task 'kv-recall' has no setting 'nope'"),
    (["run", "kv-recall", "--set", "num_pairs=x"], "setting num_pairs of task 'kv-recall' must "
     "be int or None, got 'x'"),
    (["run", "kv-recall", "--set", "num_pairs"], "--set must be NAME=VALUE"),
    (["run", "kv-recall", "--set", "values=3", "--set", "values=4"], "given twice"),
    (["run", "kv-recall", "--quick", "--set", "num_pairs=40"], "does not fit seq_len 32"),
    (["run", "dates", "--set", "num_pairs=4"], "task 'dates' has no setting 'num_pairs'"),
    (["run", "kv-recall", "--compare", "set.nope=1,2"], "has no setting 'nope'"),
    (["run", "kv-recall", "--compare", "set.values=4,04"], "the same value"),
    (["run", "kv-recall", "--set", "values=3", "--compare", "set.values=4,5"], "both set values"),
    (["run", "kv-recall", "--compare", "settings=1,2"], "settings are set one by one"),
    (["run", "kv-recall", "--compare", "num_pairs=4,8"], "num_pairs is a setting of task "
     "'kv-recall', not a configuration key; compare it as --compare set.num_pairs=4,8"),
    (["run", "dates", "--compare", "num_pairs=4,8"], "unknown key 'num_pairs'"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), SETTINGS_BAD, ids=[m for _, m in SETTINGS_BAD])
def test_bad_task_settings_are_refused_in_one_line(argv, message, capsys, tmp_path):
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, message)
    assert not (tmp_path / "out").exists()


def test_help_after_a_task_lists_its_settings_with_defaults_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "mqar", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "settings of task 'mqar' (--set NAME=VALUE):" in text
    assert "  values = 32: value tokens, the classes of an answer" in text
    assert "--d-model" not in text  # the task's page, not every flag


def test_a_grid_over_a_setting_records_each_and_reloads(tmp_path, capsys):
    import attnkit as ak

    out = tmp_path / "grid"
    argv = ["run", "kv-recall", "--quick", "--seq-len", "8", "--n-train", "16", "--n-test", "8",
            "--batch-size", "8", "--d-model", "8", "--epochs", "1", "--no-progress",
            "--threads", "1", "--set", "keys=9", "--compare", "set.num_pairs=3,7",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "| set.num_pairs |" in text
    starts = [line for line in text.splitlines() if line.startswith("attnkit run kv-recall:")]
    assert len(starts) == 2  # each run's first line names the settings set away from the defaults
    for line, pairs in zip(starts, (3, 7), strict=True):
        assert f"num_pairs={pairs}, keys=9, " in line and "values=" not in line, line
    for pairs in (3, 7):
        run_dir = out / f"set.num_pairs-{pairs}"
        saved = json.loads((run_dir / "config.json").read_text())
        assert saved["settings"] == {
            "num_pairs": pairs,
            "keys": 9,
            "values": 10,
            "layers": None,
            "num_layers": 2,
        }
        loaded = ak.load_run(run_dir)
        assert loaded.task.settings.num_pairs == pairs
        stored = loaded.task.train[0][:, :-1, 1]  # value channel before the query
        assert ((stored == 11).sum(1) == 7 - pairs).all()  # padding after the pairs
    assert cli.main(["run", "--resume", str(out / "set.num_pairs-3"), "--set", "num_pairs=4"]) == 2
    _one_error_line(capsys, "setting num_pairs = 4 contradicts its num_pairs = 3")


def test_the_first_line_of_a_supervised_run_says_it_is_supervised(tmp_path, capsys):
    argv = ["run", "kv-recall", "--quick", "--seq-len", "8", "--n-train", "8", "--n-test", "4",
            "--batch-size", "8", "--d-model", "8", "--epochs", "1", "--no-progress",
            "--threads", "1", "--supervise-attention", "0.5",
            "--out", str(tmp_path / "sup")]  # fmt: skip
    assert cli.main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("attnkit run kv-recall: ") and "supervise_attention 0.5, " in first


MANHATTAN = """
import attnkit as ak
from attnkit import taxonomy as tx


@ak.scores.REGISTRY.register("manhattan_cli")
class Manhattan(ak.scores.Score):
    scoring = tx.Scoring.SIMILARITY

    def pairwise(self, qp, kp, key_offset=0):
        return -(qp.unsqueeze(-2) - kp.unsqueeze(-3)).abs().sum(-1)
"""


@pytest.fixture
def fresh_scores(monkeypatch):
    """The score registry, the imported user files, sys.path and sys.modules put back as they
    were (as in a new process)."""
    import sys

    import attnkit as ak
    from attnkit.tasks import user

    ak.scores.available()
    table = ak.scores.REGISTRY.snapshot()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(user, "_modules", {})
    modules = set(sys.modules)

    def forget():
        ak.scores.REGISTRY.restore(table)
        user._modules.clear()
        for name in set(sys.modules) - modules:
            if name.startswith("attnkit_user_task_my_scores"):
                del sys.modules[name]

    yield forget
    forget()


def test_import_registers_a_score_for_a_built_in_task_and_the_run_imports_it_again(
    tmp_path, capsys, fresh_scores
):
    (tmp_path / "my_scores.py").write_text(MANHATTAN)
    out = tmp_path / "run"
    capsys.readouterr()
    argv = ["run", "dates", *TINY, "--score", "manhattan_cli", "--out", str(out)]
    assert cli.main(argv) == 2  # not imported: unknown, and the line says how
    _one_error_line(capsys, "unknown score 'manhattan_cli'", "--import MODULE")
    assert cli.main([*argv, "--import", str(tmp_path / "my_scores.py")]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (
        saved["imports"] == [str(tmp_path / "my_scores.py")] and saved["score"] == "manhattan_cli"
    )
    fresh_scores()  # a new process: the score is not registered
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert "all 1 epoch is trained: evaluating" in capsys.readouterr().out
    fresh_scores()
    import attnkit as ak

    assert ak.load_run(out).config.imports == saved["imports"]


def test_an_import_that_fails_is_one_line_before_anything_is_written(
    tmp_path, capsys, fresh_scores
):
    out = tmp_path / "run"
    for spec, message in [
        ("no_such_module_xyz", "--import 'no_such_module_xyz': no module named"),
        (str(tmp_path / "missing.py"), "no such file"),
    ]:
        assert cli.main(["run", "dates", *TINY, "--import", spec, "--out", str(out)]) == 2
        _one_error_line(capsys, message)
        assert not out.exists()


# a pretrained encoder under the text task (a tiny random BERT saved here: nothing downloaded)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from tiny_checkpoint import tiny_bert

    return tiny_bert(tmp_path_factory.mktemp("bert"))


def _pretrained_run(tmp_path, pretrained, *flags):
    from attnkit.tasks.text_task import TextTask

    data = TextTask.example_settings(tmp_path)["data"]
    return ["run", "text", "--data", data, "--pretrained", str(pretrained), "--seq-len", "12",
            "--n-train", "48", "--n-test", "8", "--batch-size", "16", "--lr", "1e-3",
            "--no-progress", "--threads", "1", *flags]  # fmt: skip


def test_a_pretrained_run_trains_reports_and_resumes_to_the_same_weights(
    tmp_path, capsys, monkeypatch, pretrained
):
    from attnkit.tasks.text_task import TextTask

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    argv = _pretrained_run(tmp_path, pretrained, "--epochs", "2")
    assert cli.main([*argv, "--out", str(whole)]) == 0
    saved = json.loads((whole / "config.json").read_text())
    assert saved["pretrained"] == str(pretrained) and saved["d_model"] is None
    assert saved["score"] == "scaled_dot" and saved["settings"] == {"min_count": 2}
    page = (whole / "report.html").read_text()
    text = re.sub(r"<(style|script)>.*?</\1>|<[^>]+>", " ", page, flags=re.S)
    assert "[CLS]" in page and "Attention on held-out examples" in text
    assert "gold" not in text.lower()  # the text task has no gold attention: no word of it
    loss, calls = TextTask.loss, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 4:  # epoch 2, step 1
            os.kill(os.getpid(), signal.SIGINT)
        return loss(*a)

    monkeypatch.setattr(TextTask, "loss", interrupted)
    assert cli.main([*argv, "--out", str(parts)]) == 130
    monkeypatch.undo()
    assert cli.main(["run", "--resume", str(parts), "--no-progress", "--threads", "1"]) == 0
    assert json.loads((parts / "metrics.json").read_text()) == json.loads(
        (whole / "metrics.json").read_text()
    )
    from safetensors.torch import load_file

    a = load_file(checkpoints.latest(whole) / "model.safetensors")
    b = load_file(checkpoints.latest(parts) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".attnkit_swap_load_with." in k for k in a)  # the swapped encoder was saved


def test_pretrained_runs_compare_alignments_on_the_same_model(tmp_path, capsys, pretrained):
    out = tmp_path / "cmp"
    argv = _pretrained_run(tmp_path, pretrained, "--epochs", "1")
    assert cli.main([*argv, "--compare", "align=softmax,sparsemax", "--out", str(out)]) == 0
    for align in ("softmax", "sparsemax"):
        saved = json.loads((out / f"align-{align}" / "config.json").read_text())
        assert saved["pretrained"] == str(pretrained) and saved["align"] == align
    assert (out / "compare.html").is_file()
    entropy = {
        align: json.loads((out / f"align-{align}" / "metrics.json").read_text())["entropy"]
        for align in ("softmax", "sparsemax")
    }
    assert entropy["sparsemax"] < entropy["softmax"]  # sparser rows, lower entropy


PRETRAINED_BAD = [
    (["run", "dates", "--pretrained", "minilm"], "task 'dates' takes no pretrained model"),
    (["--d-model", "32"], "--d-model 32 contradicts --pretrained"),
    (["--set", "min_count=1"], "min_count 1 contradicts --pretrained"),
    (["--seq-len", "64"], "seq_len 64 is longer than pretrained"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), PRETRAINED_BAD, ids=[m for _, m in PRETRAINED_BAD])
def test_pretrained_flags_that_do_not_apply_are_refused(
    tmp_path, capsys, pretrained, flags, message
):
    argv = flags if flags[0] == "run" else [*_pretrained_run(tmp_path, pretrained), *flags]
    assert _main([*argv, "--out", str(tmp_path / "out")]) == 2
    _one_error_line(capsys, message)
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    assert _main(["run", "text", "--data", "x.jsonl", "--pretrained", "nowhere"]) == 2
    _one_error_line(capsys)


def test_compared_text_heatmaps_keep_their_full_size_and_scroll(tmp_path, capsys):
    import base64
    import io

    from PIL import Image

    words = "the package provides a library for reading utf-8 text from c++ programs quickly"
    rows = [{"text": words if i % 2 else words.replace("quickly", "slowly"),
             "label": ("slow", "fast")[i % 2]} for i in range(40)]  # fmt: skip
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "cmp"
    argv = ["run", "text", "--data", str(data), "--n-train", "32", "--n-test", "4",
            "--epochs", "1", "--batch-size", "16", "--d-model", "8", "--no-progress",
            "--threads", "1"]  # fmt: skip
    assert cli.main([*argv, "--compare", "align=softmax,sparsemax", "--out", str(out)]) == 0
    page = (out / "compare.html").read_text()
    section = page.split("<h2>Attention side by side</h2>", 1)[1].split("<h2>", 1)[0]
    images = re.findall(r'<img alt="[^"]*" width="(\d+)" style="([^"]*)" src="data:image/png;'
                        r'base64,([^"]+)"', section)  # fmt: skip
    assert len(images) == 2 * 4
    for width, style, encoded in images:
        natural = Image.open(io.BytesIO(base64.b64decode(encoded))).size[0]
        assert int(width) == natural and "max-width:none" in style  # never shrunk
    assert natural > 360  # 14 words: wider than the column the page used to squeeze it into
    assert section.count("overflow-x:auto") == 4  # each example's row scrolls sideways
    text = re.sub(r"<(style|script)>.*?</\1>|<[^>]+>", " ", page, flags=re.S)
    assert "gold" not in text.lower()
