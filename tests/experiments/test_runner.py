"""Runs: files written, reproducible; a run stopped at any checkpoint boundary, by Ctrl-C or by a
divergence continues (or stops) correctly; digits soft and hard; DDP equals one process."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from attnkit import tasks
from attnkit.experiments import checkpoints
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.runner import Interrupted, TrainingError, run
from attnkit.tasks.base import Metric, Task
from attnkit.tasks.dates_task import DatesTask

TINY = {"n_train": 96, "n_test": 16, "batch_size": 32, "d_model": 8}


def _config(**kw):
    return RunConfig(**{"epochs": 2, **TINY, **kw})


def _run(config, out, threads=1, **kw):
    lines = []
    run_dir, metrics = run(config, out, progress=False, echo=lines.append, threads=threads, **kw)
    return run_dir, metrics, lines


def _weights(run_dir):
    return load_file(str(checkpoints.latest(run_dir) / "model.safetensors"))


def _assert_same_run(a, b):
    assert json.loads((a / "metrics.json").read_text()) == json.loads(
        (b / "metrics.json").read_text()
    )
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run every stopped run must end up equal to."""
    return _run(_config(), tmp_path_factory.mktemp("whole") / "run")[0]


def test_a_run_writes_everything_says_where_and_is_reproducible(tmp_path, whole, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    d, m, lines = _run(_config(), tmp_path / "a", threads=None)
    for name in ("config.json", "metrics.json", "report.html", "heatmap_0.png", "curves.png"):
        assert (d / name).exists(), name
    assert "data:image/png;base64," in (d / "report.html").read_text()
    env = json.loads((d / "environment.json").read_text())
    assert (
        env["threads"] == 1
        and env["processes"] == 1
        and "<h2>Environment</h2>" in (d / "report.html").read_text()
    )
    cost = json.loads((d / "cost.json").read_text())
    assert env["train_seconds"] == cost["train_seconds"] <= env["wall_seconds"]
    assert {"exact_match", "aer_argmax", "uniform_ablation_drop"} <= set(m)
    assert f"run directory: {d}" in lines
    assert any(line.startswith("threads: 1 (auto") for line in lines)
    assert [line.split()[:2] for line in lines if "validation:" in line] == [
        ["epoch", "1/2"],
        ["epoch", "2/2"],
    ]
    _assert_same_run(d, whole)


class Killed(BaseException):
    """Stands for the process dying: nothing in the runner catches it."""


@pytest.mark.parametrize("boundary", range(5))
def test_killed_at_any_checkpoint_boundary_resumes_to_the_same_run(
    tmp_path, monkeypatch, whole, boundary
):
    """Kill inside the second epoch's save: after model, optimizer, RNG, manifest, switch."""
    calls = []

    def written(path):
        calls.append(path)
        if len(calls) == 5 + boundary + 1:
            raise Killed

    monkeypatch.setattr(checkpoints, "_written", written)
    with pytest.raises(Killed):
        _run(_config(), tmp_path / "killed")
    monkeypatch.undo()
    assert not (tmp_path / "killed" / "metrics.json").exists()
    _, _, lines = _run(None, None, resume=tmp_path / "killed")
    if boundary < 4:
        assert "resuming at epoch 2, step 1 of 3" in lines
    else:
        assert "all 2 epochs are trained: evaluating" in lines
    _assert_same_run(tmp_path / "killed", whole)


KILL_AT = """
import os, sys
from attnkit import cli
from attnkit.experiments import checkpoints
calls = []
def written(path):
    calls.append(path)
    if len(calls) == int(sys.argv[1]):
        os._exit(137)  # no handler, no cleanup: as SIGKILL
checkpoints._written = written
cli.main(sys.argv[2:])
"""


def test_a_process_that_dies_mid_save_resumes_to_the_same_run(tmp_path, whole):
    """A real process exit between the optimizer and RNG files of the second save."""
    out = tmp_path / "died"
    args = ["run", "dates", "--epochs", "2", "--threads", "1", "--no-progress", "--out", str(out)]
    for key, value in TINY.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run([sys.executable, "-c", KILL_AT, "7", *args], capture_output=True)
    assert done.returncode == 137, done.stderr.decode()[-2000:]
    assert [p.name for p in (out / checkpoints.FOLDER).iterdir() if p.name.startswith(".")]
    _run(None, None, resume=out)
    assert not [p for p in (out / checkpoints.FOLDER).iterdir() if p.name.startswith(".")]
    _assert_same_run(out, whole)


def test_killed_before_the_first_checkpoint_starts_again_and_says_so(tmp_path, monkeypatch, whole):
    def written(path):
        raise Killed

    monkeypatch.setattr(checkpoints, "_written", written)
    with pytest.raises(Killed):
        _run(_config(), tmp_path / "killed")
    monkeypatch.undo()
    _, _, lines = _run(None, None, resume=tmp_path / "killed")
    assert f"no checkpoint in {tmp_path / 'killed'} yet: starting at epoch 1" in lines
    _assert_same_run(tmp_path / "killed", whole)


def _on_training_call(monkeypatch, n, action):
    """Call ``action`` inside the n-th training step's loss."""
    loss = DatesTask.loss
    calls = []

    def patched(self, model, index):
        calls.append(index)
        value = loss(self, model, index)
        return action(value) if len(calls) == n else value

    monkeypatch.setattr(DatesTask, "loss", patched)


@pytest.mark.parametrize("step", [1, 5])
def test_ctrl_c_saves_the_position_and_resume_finishes_the_same_run(
    tmp_path, monkeypatch, whole, step
):
    def interrupt(value):
        os.kill(os.getpid(), signal.SIGINT)  # held until the step is complete
        return value

    _on_training_call(monkeypatch, step, interrupt)
    with pytest.raises(Interrupted) as err:
        _run(_config(), tmp_path / "stopped")
    monkeypatch.undo()
    text = str(err.value)
    epoch, after = divmod(step, 3)
    assert f"interrupted at epoch {epoch + 1}, after step {after} of 3" in text
    assert f"continue with: attnkit run --resume {tmp_path / 'stopped'}" in text
    _run(None, None, resume=tmp_path / "stopped")
    _assert_same_run(tmp_path / "stopped", whole)


def test_a_loss_that_stops_being_finite_ends_the_run_and_keeps_the_checkpoint(
    tmp_path, monkeypatch
):
    _on_training_call(monkeypatch, 4, lambda value: value * math.nan)
    with pytest.raises(TrainingError, match=r"the loss is nan at epoch 2, step 1 \(lr 0.003\)"):
        _run(_config(), tmp_path / "diverged")
    manifest = checkpoints.latest(tmp_path / "diverged") / checkpoints.MANIFEST
    assert json.loads(manifest.read_text())["state"]["epoch"] == 1
    assert not (tmp_path / "diverged" / "metrics.json").exists()


@pytest.mark.parametrize("align", ["softmax", "hard"])
def test_digits_soft_and_hard(tmp_path, align):
    cfg = _config(task="digits", align=align, epochs=1)
    d, m, lines = _run(cfg, tmp_path / align)
    assert 0 <= m["accuracy"] <= 1 and 0 <= m["attention_correctness"] <= 1
    assert (d / "report.html").exists()
    assert any("validation: accuracy" in line for line in lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_ddp_two_processes_equal_one(tmp_path):
    args = ["run", "dates", "--epochs", "1", "--n-train", "256", "--n-test", "64"]
    args += ["--batch-size", "32", "--no-progress"]
    single = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "attnkit", *args, "--out", str(single)], check=True)
    ddp = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
            *("--master_port", str(_free_port()), "-m", "attnkit", *args, "--out", str(ddp)),
        ],
        check=True,
        env=env,
    )
    w1, w2 = _weights(single), _weights(ddp)
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["dates", "digits"])
def test_quick_variant_runs_end_to_end(task, tmp_path):
    _, metrics, _ = _run(RunConfig(task=task, quick=True), tmp_path / "quick")
    # Visibly learnt: well above chance (dates: 1 in 11 characters; digits: 1 in 10).
    assert metrics["char_accuracy" if task == "dates" else "accuracy"] > 0.25


class Toy(Task):
    """A task defined here alone: find which of 6 keys carries the marker."""

    description = "toy"
    sizes: ClassVar = {"epochs": 2, "n_train": 64, "n_test": 16, "batch_size": 16, "lr": 1e-2}
    defaults: ClassVar = {"full": {**sizes, "d_model": 8}, "quick": {**sizes, "d_model": 8}}
    metrics: ClassVar = {"accuracy": Metric("share right")}

    def __init__(self, config):
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        n = config.n_train + 2 * config.n_test
        self.x = torch.randn(n, 6, config.d_model, generator=g)
        self.y = torch.randint(0, 6, (n,), generator=g)
        self.x[torch.arange(n), self.y, 0] += 3.0
        self.split = {"train": slice(0, config.n_train)}
        self.split["validation"] = slice(config.n_train, config.n_train + config.n_test)
        self.split["test"] = slice(config.n_train + config.n_test, n)

    def build_model(self):
        from attnkit.tasks.parts import build_attention

        d = self.config.d_model
        return build_attention(self.config.score, self.config.align, d, 6)

    def n_train(self):
        return self.config.n_train

    def has_split(self, name):
        return name in self.split

    def _weights(self, model, x):
        q = torch.zeros(x.shape[0], 1, x.shape[-1])
        q[..., 0] = 1.0
        return model(q, x, need_weights=True).weights.squeeze(1)

    def loss(self, model, index):
        w = self._weights(model, self.x[index])
        return -w[torch.arange(len(index)), self.y[index]].clamp_min(1e-9).log().mean()

    @torch.no_grad()
    def evaluate(self, model, split):
        s = self.split[split]
        right = self._weights(model, self.x[s]).argmax(-1) == self.y[s]
        return {"accuracy": float(right.float().mean())}

    def heatmaps(self, model, n=4):
        return []


def test_a_task_registered_in_a_test_file_runs(tmp_path, monkeypatch):
    monkeypatch.setitem(tasks.REGISTRY._table, "toy", Toy)
    _, metrics, lines = _run(RunConfig(task="toy", score="general"), tmp_path / "toy")
    assert set(metrics) == {"accuracy"} and 0 <= metrics["accuracy"] <= 1
    assert any("validation: accuracy" in line for line in lines)
    assert "toy" in (tmp_path / "toy" / "report.html").read_text()


def test_ctrl_c_while_making_the_data_still_says_how_to_continue(tmp_path, monkeypatch, whole):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(DatesTask, "build_model", interrupted)
    with pytest.raises(Interrupted, match="before training started") as err:
        _run(_config(), tmp_path / "early")
    assert f"continue with: attnkit run --resume {tmp_path / 'early'}" in str(err.value)
    monkeypatch.undo()
    _, _, lines = _run(None, None, resume=tmp_path / "early")
    assert any("yet: starting at epoch 1" in line for line in lines)
    _assert_same_run(tmp_path / "early", whole)


# ---- context parallelism: each sequence split over a ring of processes ----------------------

CP = {"task": "kv-recall", "quick": True, "epochs": 2, "n_train": 64, "n_test": 32}
CP_SIZES = {"batch_size": 16, "seq_len": 8, "d_model": 8}


def _cp_config(**kw):
    return RunConfig(**{**CP, **CP_SIZES, **kw})


def _stopping_after_first_epoch(trainer_class):
    """An ``_end_epoch`` after which every rank stops (past the first epoch's checkpoint and
    barrier), as a job stopped between two epochs."""
    original = trainer_class._end_epoch

    def end_epoch(self):
        original(self)
        if self.position.epoch == 1:
            raise Killed

    return end_epoch


def _cp_worker(rank, world, port, out, kw, mode):
    """One process of a torchrun-like world (env:// rendezvous) running ``run`` in-process:
    ``stop`` after the first epoch, ``resume`` the run in ``out``, or ``die`` (rank 1 exits in
    the middle of the second epoch; rank 0 writes the error it raised)."""
    from attnkit.experiments import training
    from attnkit.tasks import long_range

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    if mode == "stop":
        training.Trainer._end_epoch = _stopping_after_first_epoch(training.Trainer)
    if mode == "die" and rank == 1:
        loss, calls = long_range.LongRangeTask.context_parallel_loss, []

        def dies(self, model, index, group):
            calls.append(1)
            if len(calls) == 6:  # epoch 2, step 2: after the first checkpoint
                os._exit(3)  # no handler, no cleanup: as SIGKILL
            return loss(self, model, index, group)

        long_range.LongRangeTask.context_parallel_loss = dies
    out = Path(out)
    try:
        if mode == "resume":
            run(None, resume=out, progress=False, echo=lambda _: None, threads=1, timeout=20,
                context_parallel=2)  # fmt: skip
        else:
            run(_cp_config(**kw), out, progress=False, echo=lambda _: None, threads=1,
                timeout=20)  # fmt: skip
    except Killed:
        pass
    except TrainingError as err:
        (out.parent / f"{out.name}-rank{rank}.txt").write_text(str(err))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _world(n, out, kw, mode) -> list[int]:
    """Exit codes of a forked world of ``n`` processes."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    args = (n, port, str(out), kw, mode)
    procs = [ctx.Process(target=_cp_worker, args=(r, *args)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def _same_model(a, b):
    """Runs a and b end with the same model: the same logits on the test split and the same
    weights, except the key projection's bias, whose gradient under softmax is zero in exact
    arithmetic (it adds a constant to each row of scores) and rounding noise in floats, which
    Adam scales to steps of the learning rate's size (it does not change the outputs)."""
    config = RunConfig.from_json((a / "config.json").read_text()).resolved()
    task = tasks.get(config.task)(config)
    logits = []
    for run_dir in (a, b):
        model = task.build_model()
        checkpoints.load(run_dir, model, restore_rng=False)
        with torch.no_grad():
            logits.append(model.eval()(task.splits["test"][0]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    d = config.d_model
    for k in wa:
        x, y = wa[k], wb[k]
        if k.endswith("in_proj_bias"):
            x, y = torch.cat([x[:d], x[2 * d :]]), torch.cat([y[:d], y[2 * d :]])
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=k)
    hist = [json.loads((r / "metrics.json").read_text()) for r in (a, b)]
    assert hist[0].keys() == hist[1].keys()


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """The uninterrupted one-process run; a one-process run stopped after epoch 1 and resumed
    by cp 2; dp 2 × cp 2 (4 processes) stopped after epoch 1; cp 2 with a rank that dies
    mid-step. The in-process runs go first: the forked processes inherit their imports."""
    from attnkit.experiments import training

    root = tmp_path_factory.mktemp("cp")
    _run(_cp_config(), root / "whole")
    original = training.Trainer._end_epoch
    training.Trainer._end_epoch = _stopping_after_first_epoch(training.Trainer)
    try:
        with pytest.raises(Killed):
            _run(_cp_config(), root / "one_then_ring")
    finally:
        training.Trainer._end_epoch = original
    assert _world(2, root / "one_then_ring", None, "resume") == [0] * 2
    assert _world(4, root / "ring_then_one", {"context_parallel": 2}, "stop") == [0] * 4
    codes = _world(2, root / "dies", {"context_parallel": 2}, "die")
    assert codes[1] == 3, codes
    return root


def test_a_ring_run_resumed_on_one_process_equals_the_uninterrupted_run(cp_runs, capsys):
    from attnkit import cli

    stopped = cp_runs / "ring_then_one"
    assert checkpoints.latest(stopped).name == "1" and not (stopped / "metrics.json").exists()
    resume = ["run", "--resume", str(stopped), "--no-progress", "--threads", "1"]
    assert cli.main(resume) == 2  # recorded: context_parallel 2; this world: 1 process
    said = capsys.readouterr().err
    assert "context_parallel 2 does not divide the 1 process" in said
    assert "continue it with --context-parallel 1" in said
    assert cli.main([*resume, "--context-parallel", "1"]) == 0  # the one key a resume changes
    assert "resuming at epoch 2, step 1 of 4" in capsys.readouterr().out
    _same_model(stopped, cp_runs / "whole")


def test_a_one_process_run_resumed_on_a_ring_equals_the_uninterrupted_run(cp_runs):
    _same_model(cp_runs / "one_then_ring", cp_runs / "whole")


def test_a_rank_that_dies_mid_step_stops_the_others_and_keeps_the_checkpoint(cp_runs):
    run_dir = cp_runs / "dies"
    said = (cp_runs / "dies-rank0.txt").read_text()
    assert "rank 0 of 2: a process stopped or did not answer at epoch 2, step 2" in said
    assert f"continue with: attnkit run --resume {run_dir}" in said
    assert not (run_dir / "metrics.json").exists()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["1"]
    state = json.loads((run_dir / "checkpoints" / "1" / "state.json").read_text())["state"]
    assert (state["epoch"], state["step"]) == (1, 0)


def test_context_parallel_is_refused_where_it_cannot_split(tmp_path):
    with pytest.raises(ConfigError, match=r"task 'dates' cannot split its sequences.*kv-recall"):
        _run(_config(context_parallel=2), tmp_path / "a")
    with pytest.raises(ConfigError, match="seq_len 9 does not split into 2 equal parts"):
        _run(_cp_config(context_parallel=2, seq_len=9), tmp_path / "b")
    with pytest.raises(ConfigError, match="attention 'performer' cannot be split over a ring"):
        _run(_cp_config(context_parallel=2, attention="performer"), tmp_path / "c")
    with pytest.raises(ConfigError, match="cannot evaluate score 'additive' with align 'hard'"):
        _run(_cp_config(context_parallel=2, score="additive", align="hard"), tmp_path / "d")
    with pytest.raises(ConfigError, match="context_parallel must be a positive int"):
        _run(_cp_config(context_parallel=0), tmp_path / "e")
    with pytest.raises(ConfigError, match="context_parallel 2 does not divide the 1 process"):
        _run(_cp_config(context_parallel=2), tmp_path / "f")
    assert not any((tmp_path / n).exists() for n in "abcdef")  # nothing written


@pytest.mark.slow
def test_torchrun_context_parallel_equals_one_process(tmp_path):
    args = ["run", "kv-recall", "--quick", "--epochs", "1", "--n-train", "64", "--n-test", "32"]
    args += ["--batch-size", "16", "--seq-len", "8", "--d-model", "8", "--no-progress"]
    single = tmp_path / "single"
    subprocess.run([sys.executable, "-m", "attnkit", *args, "--out", str(single)], check=True)
    ring = tmp_path / "ring"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"),
            *("--master_port", str(_free_port()), "-m", "attnkit", *args),
            *("--context-parallel", "2", "--out", str(ring)),
        ],
        check=True,
        env=env,
    )
    _same_model(single, ring)
