"""``attnkit run``: train a task model, checkpoint every epoch, evaluate the attention, report.

Data-parallel when started by ``torchrun`` (DDP; gloo on CPU, nccl on GPU): every rank takes an
equal slice of each global batch and the gradients are averaged, which equals single-process
training on the global batch.

A run can stop at any point and continue with ``--resume`` to the same result as if it had not
stopped: the data order depends only on (seed, epoch), checkpoints are atomic sets that include
the random state, and Ctrl-C saves the position inside the epoch (between two steps).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from attnkit import tasks
from attnkit.experiments import checkpoints
from attnkit.experiments.config import ConfigError, RunConfig, check_output_dir
from attnkit.experiments.report import metric_rows, write_report
from attnkit.experiments.threads import choose_threads, count_flops

__all__ = ["Interrupted", "TrainingError", "load_config", "resume_command", "run"]


class TrainingError(RuntimeError):
    """Training cannot go on (the loss is no longer finite); the message says what to change."""


class Interrupted(Exception):
    """Ctrl-C: what could be saved is saved; ``str()`` says how to continue."""


def resume_command(run_dir: Path) -> str:
    return f"attnkit run --resume {shlex.quote(str(run_dir))}"


def load_config(run_dir: Path) -> RunConfig:
    """The configuration saved in a run directory; ConfigError when it is missing or damaged."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"--resume {str(run_dir)!r}: not a run directory (no config.json)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None
    return RunConfig.from_json(text, source=str(path))


def _default_out(config: RunConfig) -> Path:
    base = Path("runs") / f"{config.run_name()}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="batch",
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
    )


class _StepGuard:
    """Ctrl-C arriving inside a training step is held until the step is complete, so the
    saved position is always between two steps; outside a step it interrupts at once."""

    def __init__(self) -> None:
        self.in_step = False
        self.pending = False
        self._previous = None

    def __enter__(self) -> _StepGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.in_step and not self.pending:
            self.pending = True
            return
        raise KeyboardInterrupt

    def step_done(self) -> None:
        self.in_step = False
        if self.pending:
            raise KeyboardInterrupt


def _format(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())


def run(
    config: RunConfig,
    out: Path | None = None,
    *,
    resume: Path | None = None,
    progress: bool = True,
    threads: int | None = None,
    echo: Callable[[str], None] | None = None,
) -> tuple[Path, dict]:
    """Train and evaluate; returns (run directory, held-out metrics).

    Raises ConfigError on bad input before writing anything, CheckpointError for a damaged
    checkpoint, TrainingError when the loss stops being finite, Interrupted on Ctrl-C (after
    saving the position).
    """
    if resume is not None:
        config = load_config(resume)
    config = config.resolved()
    if resume is None:
        run_dir = out if out is not None else _default_out(config)
        check_output_dir(run_dir)
    else:
        run_dir = resume
    rank, world = _distributed()
    say = (echo or (lambda text: print(text, flush=True))) if rank == 0 else (lambda text: None)
    if config.batch_size % world:
        raise ConfigError(
            f"batch_size {config.batch_size} is not divisible by the {world} processes"
        )
    if resume is None and rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            checkpoints.atomic_write(
                run_dir / "config.json", lambda p: p.write_text(config.to_json())
            )
        except OSError as err:
            raise ConfigError(f"output directory {str(run_dir)!r}: {err.strerror}") from None
    try:  # making the data can take a while: Ctrl-C here still says how to continue
        torch.manual_seed(config.seed)
        task = tasks.get(config.task)(config)
        model = task.build_model()
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted before training started; the configuration is in {run_dir}\n"
            f"continue with: {resume_command(run_dir)}"
        ) from None
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    n = task.n_train()
    steps = n // config.batch_size
    first = torch.arange(config.batch_size // world)
    flops = count_flops(lambda: task.loss(model, first)) if threads is None else 0
    n_threads, why = choose_threads(threads, flops)
    torch.set_num_threads(n_threads)
    say(
        f"attnkit run {config.task}: score {config.score}, align {config.align}, "
        f"{config.epochs} epochs of {steps} steps (n_train {n}, batch {config.batch_size}), "
        f"seed {config.seed}"
    )
    say(f"threads: {n_threads} ({why})")
    say(f"run directory: {run_dir}")

    state = None
    if resume is not None:
        state = checkpoints.load(run_dir, model, optimizer)
        if state is None:
            say(f"no checkpoint in {run_dir} yet: starting at epoch 1")
    state = state or {"epoch": 0, "step": 0, "loss_sum": 0.0, "history": []}
    history: list[dict] = state["history"]
    epoch, step = state["epoch"], state["step"]
    if resume is not None and epoch >= config.epochs:
        say(f"all {config.epochs} epochs are trained: evaluating")
    elif resume is not None and epoch + step > 0:
        say(f"resuming at epoch {epoch + 1}, step {step + 1} of {steps}")
    trained = DistributedDataParallel(model) if world > 1 else model

    saved = (epoch, step)

    def save(epoch: int, step: int, loss_sum: float) -> None:
        nonlocal saved
        if rank == 0:
            progress_state = {"epoch": epoch, "step": step, "loss_sum": loss_sum}
            checkpoints.save(run_dir, model, optimizer, {**progress_state, "history": history})
        saved = (epoch, step)

    loss_sum = state["loss_sum"]
    try:
        with _StepGuard() as guard:
            while epoch < config.epochs:
                model.train()
                # The order depends only on (seed, epoch): a resumed run sees the same batches.
                order = torch.randperm(
                    n, generator=torch.Generator().manual_seed(config.seed * 1000 + epoch)
                )
                desc = f"epoch {epoch + 1}/{config.epochs}"
                with _progress(steps, desc, progress and rank == 0) as bar:
                    bar.update(step)
                    while step < steps:
                        guard.in_step = True
                        batch = order[step * config.batch_size : (step + 1) * config.batch_size]
                        loss = task.loss(trained, batch.chunk(world)[rank])
                        value = float(loss.detach())
                        if not math.isfinite(value):
                            raise TrainingError(
                                f"training diverged: the loss is {value} at epoch {epoch + 1}, "
                                f"step {step + 1} (lr {config.lr:g}); the checkpoints of "
                                f"completed epochs in {run_dir} are kept. Try a smaller "
                                + (
                                    "--lr"
                                    if not config.supervise_attention
                                    else "--lr or --supervise-attention"
                                )
                            )
                        optimizer.zero_grad()
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                        optimizer.step()
                        loss_sum += value
                        step += 1
                        bar.set_postfix(loss=f"{loss_sum / step:.4f}")
                        bar.update()
                        guard.step_done()
                record = {"epoch": epoch + 1, "loss": loss_sum / steps}
                if rank == 0 and task.has_split("validation"):
                    val = task.evaluate(model, "validation")
                    record.update({f"val_{k}": v for k, v in val.items()})
                    say(f"{desc}  loss {record['loss']:.4f}  validation: {_format(val)}")
                else:
                    say(f"{desc}  loss {record['loss']:.4f}")
                history.append(record)
                epoch, step, loss_sum = epoch + 1, 0, 0.0
                save(epoch, step, loss_sum)
                if world > 1:
                    dist.barrier()
    except KeyboardInterrupt:
        if history and history[-1]["epoch"] == epoch + 1:  # stopped between these two lines
            epoch, step, loss_sum = epoch + 1, 0, 0.0
        if (epoch, step) != saved:
            save(epoch, step, loss_sum)
        if epoch < config.epochs:
            where = f"epoch {epoch + 1}, after step {step} of {steps}"
        else:
            where = "training complete, before the final evaluation"
        raise Interrupted(
            f"interrupted at {where}; saved in {run_dir}\ncontinue with: {resume_command(run_dir)}"
        ) from None
    metrics: dict = {}
    if rank == 0:
        metrics = task.final_metrics(model)
        checkpoints.atomic_write(
            run_dir / "metrics.json", lambda p: p.write_text(json.dumps(metrics, indent=2))
        )
        report = write_report(
            run_dir, asdict(config), metrics, history, task.heatmaps(model), task.metrics
        )
        say("held-out metrics:")
        width = max(len(name) for name in metrics)
        for name, value, reading, meaning in metric_rows(metrics, task.metrics):
            say(f"  {name:<{width}}  {value}  {reading:<16}  {meaning}".rstrip())
        say(f"report: {report}")
    if world > 1:
        dist.barrier()
    return run_dir, metrics
