"""``attnkit run``: train a task model, checkpoint every epoch, evaluate the attention, report.

Data-parallel when started by ``torchrun`` (DDP; gloo on CPU, nccl on GPU): every rank takes an
equal slice of each global batch and the gradients are averaged, which equals single-process
training on the global batch. With ``context_parallel`` P > 1 (``--context-parallel P``, tasks
with ``Task.context_parallel``) each sequence is split over P ranks that run ring attention, and
the world is data-parallel replicas × P (:mod:`attnkit.experiments.training`).

A run can stop at any point and continue with ``--resume`` to the same result as if it had not
stopped: the data order depends only on (seed, epoch), checkpoints are atomic sets that include
the random state, and Ctrl-C saves the position inside the epoch (between two steps).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from attnkit import tasks
from attnkit.distributed.groups import ring_groups
from attnkit.experiments import checkpoints, cost, environment, failures, metrics_file
from attnkit.experiments.config import ConfigError, RunConfig, check_output_dir
from attnkit.experiments.kernel_choice import apply_kernel
from attnkit.experiments.report import metric_rows, write_report
from attnkit.experiments.threads import choose_threads, count_flops
from attnkit.experiments.training import (
    Interrupted,
    Position,
    Trainer,
    TrainingError,
    resume_command,
)

__all__ = ["Interrupted", "TrainingError", "load_config", "resume_command", "run"]


def load_config(run_dir: Path) -> RunConfig:
    """The configuration saved in a run directory; ConfigError when it is missing or damaged."""
    path = run_dir / "config.json"
    if not path.is_file():
        runs = sorted(p.parent for p in run_dir.glob("*/config.json"))
        hint = f"; it holds runs to resume one by one, e.g. {str(runs[0])!r}" if runs else ""
        raise ConfigError(f"--resume {str(run_dir)!r}: not a run directory (no config.json){hint}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read ({err})") from None
    return RunConfig.from_json(text, source=str(path))


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1: "1 epoch", "4 epochs"."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def _default_out(config: RunConfig) -> Path:
    base = Path("runs") / f"{config.run_name()}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


TIMEOUT = 300.0  # seconds a process waits for the others before it stops with an error


def _distributed(timeout: float = TIMEOUT) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            timeout=datetime.timedelta(seconds=timeout),
        )
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def run(
    config: RunConfig,
    out: Path | None = None,
    *,
    resume: Path | None = None,
    progress: bool = True,
    threads: int | None = None,
    echo: Callable[[str], None] | None = None,
    context_parallel: int | None = None,
    timeout: float = TIMEOUT,
) -> tuple[Path, dict]:
    """Train and evaluate; returns (run directory, held-out metrics).

    ``context_parallel`` replaces the configuration's (a resumed run may continue with each
    sequence split over another number of processes: the weights do not depend on it);
    ``timeout``: seconds a process of a distributed run waits for the others.

    Raises ConfigError on bad input before writing anything, CheckpointError for a damaged
    checkpoint, TrainingError when the loss stops being finite or a process of a distributed
    run stops, Interrupted on Ctrl-C (after saving the position).
    """
    if resume is not None:
        config = load_config(resume)
    if context_parallel is not None:
        config = replace(config, context_parallel=context_parallel)
    config = config.resolved()
    if resume is None:
        run_dir = out if out is not None else _default_out(config)
        check_output_dir(run_dir)
    else:
        run_dir = resume
    rank, world = _distributed(timeout)
    say = (echo or (lambda text: print(text, flush=True))) if rank == 0 else (lambda text: None)
    cp = config.context_parallel
    if world % cp:
        raise ConfigError(
            f"context_parallel {cp} does not divide the {world} process{'es' if world > 1 else ''} "
            "of this run "
            f"(the world is data-parallel replicas × context_parallel); start it with torchrun "
            f"--nproc_per_node a multiple of {cp}"
            + (", or continue it with --context-parallel 1" if resume is not None else "")
        )
    replicas = world // cp
    if config.batch_size % replicas:
        what = "processes" if cp == 1 else f"data-parallel replicas ({world} processes / {cp})"
        raise ConfigError(
            f"batch_size {config.batch_size} is not divisible by the {replicas} {what}"
        )
    if resume is None and rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            checkpoints.atomic_write(
                run_dir / "config.json", lambda p: p.write_text(config.to_json())
            )
        except OSError as err:
            raise ConfigError(f"output directory {str(run_dir)!r}: {err.strerror}") from None
    with failures.in_run(run_dir):  # a failure from here on says how to continue
        return _train(
            config, run_dir, resume, rank, world, replicas, say, progress, threads, timeout
        )


def _train(config: RunConfig, run_dir: Path, resume: Path | None, rank: int, world: int,
           replicas: int, say: Callable[[str], None], progress: bool,
           threads: int | None, timeout: float) -> tuple[Path, dict]:  # fmt: skip
    """The run after its directory is made: train, evaluate, report."""
    cp = config.context_parallel
    try:  # making the data can take a while: Ctrl-C here still says how to continue
        torch.manual_seed(config.seed)
        task = tasks.get(config.task)(config)
        model = task.build_model()
        apply_kernel(model, config.kernel)
    except ValueError as err:  # the task refuses its data (a file of the user's)
        raise ConfigError(str(err)) from err
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted before training started; the configuration is in {run_dir}\n"
            f"continue with: {resume_command(run_dir)}"
        ) from None
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    n = task.n_train()
    steps = n // config.batch_size
    first = torch.arange(config.batch_size // replicas)
    flops = count_flops(lambda: task.loss(model, first)) if threads is None else 0
    n_threads, why = choose_threads(threads, flops)
    torch.set_num_threads(n_threads)
    said = [
        f"{key} {value}"
        for key, value in (("attention", config.attention), ("score", config.score),
                           ("align", config.align))
        if value not in (None, "default")
    ]  # fmt: skip
    defaults = type(task).resolve_settings(None)  # the settings set away from their defaults
    said += [
        f"{name}={getattr(task.settings, name)}"
        for name in type(task).setting_fields()
        if getattr(task.settings, name) != getattr(defaults, name)
    ]
    if config.supervise_attention > 0:
        said.append(f"supervise_attention {config.supervise_attention}")
    said += [
        f"{plural(config.epochs, 'epoch')} of {plural(steps, 'step')} (n_train {n}, batch "
        f"{config.batch_size})",
        f"seed {config.seed}",
    ]
    if world > 1:
        said.append(f"{world} processes: {replicas} data-parallel × {cp} context-parallel")
    say(f"attnkit run {config.task}: {', '.join(said)}")
    say(f"threads: {n_threads} ({why})")
    say(f"run directory: {run_dir}")

    position = Position()
    if resume is not None:
        state = checkpoints.load(run_dir, model, optimizer)
        if state is None:
            say(f"no checkpoint in {run_dir} yet: starting at epoch 1")
        else:
            position = _position(state, checkpoints.latest(run_dir), config, steps)
    if resume is not None and position.stopped:
        say(f"training stopped early at epoch {position.epoch}: evaluating")
    elif resume is not None and position.epoch >= config.epochs:
        say(
            f"all {plural(config.epochs, 'epoch')} {'is' if config.epochs == 1 else 'are'} "
            "trained: evaluating"
        )
    elif resume is not None and position.epoch + position.step > 0:
        say(f"resuming at epoch {position.epoch + 1}, step {position.step + 1} of {steps}")
    ring, trained = None, None
    if cp > 1:
        ring = ring_groups(cp, timeout=timeout)  # the ring waits --timeout, as the world
        trained = task.context_parallel_model(model, ring)
    elif world > 1:
        trained = DistributedDataParallel(model)
    trainer = Trainer(
        config,
        task,
        model,
        optimizer,
        run_dir,
        position,
        trained=trained,
        rank=rank,
        world=world,
        say=say,
        progress=progress,
        ring=ring,
    )
    if rank == 0 and position.best is not None:
        trainer.best_weights = checkpoints.load_best(run_dir)
        if trainer.best_weights is None:
            raise checkpoints.CheckpointError(
                f"damaged checkpoint: {checkpoints.latest(run_dir)}: its position names a best "
                f"epoch but it holds no {checkpoints.BEST}"
            )
    started = time.perf_counter()
    with cost.measure() as spent:
        history = trainer.fit()
    metrics: dict = {}
    if rank == 0 and trainer.best_weights is not None:
        model.load_state_dict(trainer.best_weights)
        best = trainer.position.best
        say(
            f"held-out evaluation with the weights of epoch {best['epoch']} (best validation "
            f"{config.best_metric} {best['value']:.4f})"
        )
    if rank == 0:
        checkpoints.atomic_write(
            run_dir / "cost.json", lambda p: p.write_text(json.dumps(spent, indent=2))
        )
        metrics = task.final_metrics(model)
        metrics_file.check(metrics, config.task, type(task), "final_metrics (held-out)")
        metrics_file.write(run_dir, metrics)
        maps = task.heatmaps(model)
        env = environment.collect(
            threads=n_threads,
            processes=world,
            wall_seconds=time.perf_counter() - started,
            train_seconds=spent["train_seconds"],
            device=str(next(model.parameters(), torch.empty(0)).device),
        )
        report = write_report(
            run_dir,
            asdict(config),
            metrics,
            history,
            maps,
            task.metrics,
            environment=env,
            best=trainer.position.best if trainer.best_weights is not None else None,
            tables=task.report_tables(model),
        )
        say("held-out metrics:")
        width = max(len(name) for name in metrics)
        for name, value, reading, meaning in metric_rows(metrics, task.metrics):
            say(f"  {name:<{width}}  {value}  {reading:<16}  {meaning}".rstrip())
        say(f"report: {report}")
    if world > 1:
        dist.barrier()
    return run_dir, metrics


def _position(state: dict, directory: Path, config: RunConfig, steps: int) -> Position:
    """The training position saved in a checkpoint; CheckpointError naming the file if the
    saved values are not a position of this run (``steps`` steps per epoch)."""
    kinds = {"epoch": int, "step": int, "loss_sum": (int, float), "history": list,
             "best": (dict, type(None)), "stopped": bool}  # fmt: skip
    path = directory / checkpoints.MANIFEST
    if set(state) != set(kinds) or not all(
        isinstance(state[k], kind) and (k == "stopped" or not isinstance(state[k], bool))
        for k, kind in kinds.items()
    ):
        raise checkpoints.CheckpointError(
            f"damaged checkpoint: {path}: the saved position must "
            f"be {', '.join(kinds)} (ints, a number, a list, a dict or null and a bool), got "
            f"{state!r:.200}"
        )
    epoch, step, history = state["epoch"], state["step"], state["history"]
    best = state["best"]
    if best is not None and not (
        set(best) == {"epoch", "value"}
        and isinstance(best["epoch"], int)
        and 1 <= best["epoch"] <= len(history)
        and isinstance(best["value"], int | float)
    ):
        raise checkpoints.CheckpointError(
            f"damaged checkpoint: {path}: the saved best epoch must be epoch (one of the "
            f"{len(history)} trained) and value, got {best!r:.200}"
        )
    if (best is not None) != (config.best_metric is not None and len(history) > 0):
        raise checkpoints.CheckpointError(
            f"damaged checkpoint: {path}: a best epoch is saved {'' if best else 'not '}but the "
            f"run's best_metric is {config.best_metric!r}"
        )
    if not (0 <= epoch <= config.epochs and 0 <= step <= steps and len(history) == epoch):
        raise checkpoints.CheckpointError(
            f"damaged checkpoint: {path}: the saved position (epoch {epoch}, step {step}, "
            f"{plural(len(history), 'epoch')} of history) is not one of this run "
            f"({plural(config.epochs, 'epoch')} of {plural(steps, 'step')})"
        )
    return Position(**state)
