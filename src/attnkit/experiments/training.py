"""The training loop of ``attnkit run``: epochs of steps, validation and a checkpoint after each
epoch, a stop on a non-finite loss, and Ctrl-C saving the position between two steps.

The data order depends only on (seed, epoch), and a checkpoint holds the weights, the optimizer,
the random state and the position (epoch, step, running loss, history, the best epoch so far and
whether early stopping ended training), so training resumed from any checkpoint gives the same
result as training that never stopped. The learning rate of a step is a function of its number
(:mod:`attnkit.experiments.schedule`), which the position gives; with ``best_metric`` the
checkpoint also keeps the best epoch's weights, all of it under the checkpoint's checksums.

Under context parallelism (``context_parallel`` P > 1) the world of processes is D data-parallel
replicas × P ranks that split each sequence (a ring): each replica takes 1/D of each global
batch, each rank of its ring computes its part of the replica's loss
(:meth:`attnkit.tasks.base.Task.context_parallel_loss`), and the gradients are summed over the
ring and averaged over the replicas, which equals one process training on the global batch. The
position counts global steps, so a run may resume on another number of processes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from attnkit.distributed import RingError
from attnkit.experiments import checkpoints, metrics_file
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.interrupts import StepGuard
from attnkit.experiments.logs import RunLog
from attnkit.experiments.schedule import lr_factor
from attnkit.regularisers import auxiliary_loss
from attnkit.tasks.base import Task

__all__ = ["Interrupted", "Position", "Trainer", "TrainingError", "resume_command"]


class TrainingError(RuntimeError):
    """Training cannot go on (the loss is no longer finite); the message says what to change."""


class Interrupted(Exception):
    """Ctrl-C: what could be saved is saved; ``str()`` says how to continue."""


def resume_command(run_dir: Path) -> str:
    import shlex

    return f"attnkit run --resume {shlex.quote(str(run_dir))}"


@dataclass
class Position:
    """Where training stands: ``step`` steps of epoch ``epoch + 1`` are done (epochs count
    from 0 here), with ``loss_sum`` their summed loss; ``history`` has one record per
    completed epoch. ``best`` is ``{"epoch": e, "value": v}``, the epoch (from 1) with the best
    value v of the run's ``best_metric`` so far (None before the first, or without one);
    ``stopped`` is True once early stopping ended training."""

    epoch: int = 0
    step: int = 0
    loss_sum: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    stopped: bool = False

    def next_epoch(self) -> None:
        self.epoch, self.step, self.loss_sum = self.epoch + 1, 0, 0.0


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


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())


class Trainer:
    """Trains ``model`` on ``task`` from ``position`` to ``config.epochs``; rank 0 checkpoints
    into ``run_dir``. ``trained`` is the module that computes the loss (the DDP wrapper when
    data-parallel, the ring twin when context-parallel). ``ring`` is this rank's ring group when
    ``config.context_parallel`` > 1: consecutive ranks r = replica·P + i form a ring."""

    def __init__(
        self,
        config: RunConfig,
        task: Task,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        run_dir: Path,
        position: Position,
        *,
        trained: nn.Module | None = None,
        rank: int = 0,
        world: int = 1,
        say: Callable[[str], None] = print,
        progress: bool = True,
        ring: Any = None,
    ) -> None:
        self.config, self.task, self.model, self.optimizer = config, task, model, optimizer
        self.run_dir, self.position = run_dir, position
        self.trained = model if trained is None else trained
        self.rank, self.world, self.say, self.progress = rank, world, say, progress
        self.cp = config.context_parallel
        self.replicas, self.replica = world // self.cp, rank // self.cp
        self.ring = ring
        self.steps = task.n_train() // config.batch_size
        self.total_steps = config.epochs * self.steps
        self.base_lr = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self.base_lr, strict=True):
            group["initial_lr"] = lr  # the schedule's base rate, saved with the optimizer
        # the best epoch's weights (rank 0; with best_metric), restored by the runner on resume
        self.best_weights: dict[str, torch.Tensor] | None = None
        if config.best_metric is not None and not task.has_split("validation"):
            raise ConfigError(
                f"best_metric {config.best_metric!r}: task {config.task!r} has no validation "
                "split to choose the best epoch on"
            )
        self._saved = (position.epoch, position.step)
        self.log = RunLog(run_dir, self.steps, position.epoch, position.step, enabled=rank == 0)

    def save(self) -> None:
        p = self.position
        if self.rank == 0:
            checkpoints.save(
                self.run_dir, self.model, self.optimizer, asdict(p), best=self.best_weights
            )
        self._saved = (p.epoch, p.step)

    def fit(self) -> list[dict[str, Any]]:
        """Train to the last epoch; return the history. Raises TrainingError or Interrupted."""
        p = self.position
        try:
            with StepGuard() as guard:
                while p.epoch < self.config.epochs and not p.stopped:
                    self._epoch(guard)
                    self._end_epoch()
        except KeyboardInterrupt:
            if p.history and p.history[-1]["epoch"] == p.epoch + 1:
                p.next_epoch()  # stopped between recording the epoch and moving on
            if (p.epoch, p.step) != self._saved:
                self.save()
            if p.epoch < self.config.epochs and not p.stopped:
                where = f"epoch {p.epoch + 1}, after step {p.step} of {self.steps}"
            else:
                where = "training complete, before the final evaluation"
            raise Interrupted(
                f"interrupted at {where}; saved in {self.run_dir}\n"
                f"continue with: {resume_command(self.run_dir)}"
            ) from None
        finally:
            self.log.close()
        return p.history

    def _epoch(self, guard: StepGuard) -> None:
        c, p = self.config, self.position
        self.model.train()
        order = torch.randperm(
            self.task.n_train(), generator=torch.Generator().manual_seed(c.seed * 1000 + p.epoch)
        )
        desc = f"epoch {p.epoch + 1}/{c.epochs}"
        with _progress(self.steps, desc, self.progress and self.rank == 0) as bar:
            bar.update(p.step)
            while p.step < self.steps:
                guard.in_step = True
                batch = order[p.step * c.batch_size : (p.step + 1) * c.batch_size]
                if self.cp > 1:
                    value = self._ring_step(batch.chunk(self.replicas)[self.replica])
                else:
                    loss = self.task.loss(self.trained, batch.chunk(self.world)[self.rank])
                    extra = auxiliary_loss(self.model)  # parts' own penalties (adaptive span)
                    if extra is not None:
                        loss = loss + extra
                    value = float(loss.detach())
                    if not math.isfinite(value):
                        raise TrainingError(self._diverged(value))
                    self.optimizer.zero_grad()
                    loss.backward()
                if c.clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.clip_norm)
                self._set_lr(p.epoch * self.steps + p.step)
                self.optimizer.step()
                p.loss_sum += value
                p.step += 1
                self.log.step(p.epoch + 1, p.step, value)
                bar.set_postfix(loss=f"{p.loss_sum / p.step:.4f}")
                bar.update()
                guard.step_done()

    def _set_lr(self, step: int) -> None:
        """The scheduled rate of the run's step ``step`` (from 0) in every parameter group."""
        c = self.config
        f = lr_factor(step, self.total_steps, warmup=c.warmup_steps, kind=c.schedule)
        for group, lr in zip(self.optimizer.param_groups, self.base_lr, strict=True):
            group["lr"] = lr * f

    def _ring_step(self, index: torch.Tensor) -> float:
        """Forward and backward of one step with each sequence split over the ring; the
        gradients summed over the ring and averaged over the replicas. Returns the global
        batch's loss. A rank that stops makes the others raise TrainingError."""
        try:
            loss = self.task.context_parallel_loss(self.trained, index, self.ring)
            extra = auxiliary_loss(self.model)
            if extra is not None:  # counted once over the ring
                loss = loss + extra / self.cp
            # the parts summed over the world: replicas × the global batch's mean loss
            value = float(self._sum(loss.detach().reshape(1).double())) / self.replicas
            if not math.isfinite(value):
                raise TrainingError(self._diverged(value))
            self.optimizer.zero_grad()
            loss.backward()
        except RingError as err:
            raise TrainingError(self._stopped(err)) from err
        params = [q for q in self.model.parameters() if q.requires_grad]
        grads = [torch.zeros_like(q) if q.grad is None else q.grad for q in params]
        flat = self._sum(torch.cat([g.reshape(-1) for g in grads])) / self.replicas
        for q, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            q.grad = g.view_as(q).clone()
        return value

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over every process; a process that stopped: TrainingError."""
        try:
            dist.all_reduce(x)
        except RuntimeError as err:
            raise TrainingError(self._stopped(err)) from err
        return x

    def _stopped(self, err: Exception) -> str:
        p = self.position
        return (
            f"rank {self.rank} of {self.world}: a process stopped or did not answer at epoch "
            f"{p.epoch + 1}, step {p.step + 1}; the newest complete checkpoint in "
            f"{self.run_dir} is kept; continue with: "
            f"{resume_command(self.run_dir)} (on any number of processes that "
            f"--context-parallel divides). Cause: {str(err).splitlines()[0]}"
        )

    def _end_epoch(self) -> None:
        p = self.position
        record: dict[str, Any] = {"epoch": p.epoch + 1, "loss": p.loss_sum / self.steps}
        line = f"epoch {p.epoch + 1}/{self.config.epochs}  loss {record['loss']:.4f}"
        if self.rank == 0 and self.task.has_split("validation"):
            val = self.task.evaluate(self.model, "validation")
            metrics_file.check(
                val,
                self.config.task,
                type(self.task),
                f"evaluate('validation') at epoch {p.epoch + 1}",
            )
            record.update({f"val_{k}": v for k, v in val.items()})
            line += f"  validation: {format_metrics(val)}"
        record["lr"] = self.optimizer.param_groups[0]["lr"]
        if self.config.best_metric is not None:
            line += self._track_best(record)
        note = self.task.end_epoch(self.model, p.epoch + 1)  # every rank: the same change
        if note:
            line += f"  ({note})"
        self.say(line)
        self.log.epoch(record)
        p.history.append(record)
        p.next_epoch()
        if p.stopped and p.epoch < self.config.epochs:
            self.say(
                f"early stopping: {self.config.best_metric} has not improved for "
                f"{self.config.patience} epochs (best: epoch {p.best['epoch']}, "
                f"{p.best['value']:.4f})"
            )
        self.save()
        if self.world > 1:
            dist.barrier()

    def _track_best(self, record: dict[str, Any]) -> str:
        """Keep the weights of the epoch just validated when it is the best so far by
        ``best_metric`` (strictly better than the best before), and stop training after
        ``patience`` epochs without one; every process learns whether to stop. Returns a few
        words for the epoch's line."""
        c, p = self.config, self.position
        epoch, note = p.epoch + 1, ""
        if self.rank == 0:
            key = f"val_{c.best_metric}"
            if key not in record:
                given = ", ".join(k[4:] for k in record if k.startswith("val_")) or "none"
                raise ConfigError(
                    f"best_metric {c.best_metric!r}: task {c.task!r} does not give it on the "
                    f"validation split (it gives: {given}); start a new run with one of those"
                )
            value = float(record[key])
            higher = self.task.metrics[c.best_metric].better == "higher"
            best = p.best
            if best is None or (value > best["value"] if higher else value < best["value"]):
                p.best = {"epoch": epoch, "value": value}
                self.best_weights = {
                    k: v.detach().clone() for k, v in self.model.state_dict().items()
                }
                note = "  (best so far)"
            waited = epoch - p.best["epoch"]
            p.stopped = c.patience is not None and waited >= c.patience and epoch < c.epochs
        if self.world > 1:  # the decision is rank 0's: every rank stops together
            flag = torch.tensor([int(p.stopped)])
            dist.broadcast(flag, 0)
            p.stopped = bool(flag.item())
        return note

    def _diverged(self, value: float) -> str:
        c, p = self.config, self.position
        knobs = "--lr or --supervise-attention" if c.supervise_attention else "--lr"
        return (
            f"training diverged: the loss is {value} at epoch {p.epoch + 1}, step {p.step + 1} "
            f"(lr {c.lr:g}); the checkpoints of completed epochs in {self.run_dir} are kept. "
            f"Try a smaller {knobs}"
        )
