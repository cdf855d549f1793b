"""``attnkit run``: train a task model, checkpoint every epoch, evaluate the attention, report.

Data-parallel when started by ``torchrun`` (DDP; gloo on CPU, nccl on GPU): every rank takes an
equal slice of each global batch and the gradients are averaged, which equals single-process
training on the global batch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from attnkit.experiments import checkpoints
from attnkit.experiments.config import ConfigError, RunConfig, check_writable
from attnkit.experiments.report import write_report

__all__ = ["run"]


def _task(config: RunConfig):
    if config.task == "dates":
        from attnkit.experiments.dates import DatesTask

        return DatesTask(config)
    from attnkit.experiments.digits import DigitsTask

    return DigitsTask(config)


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
    )


def run(
    config: RunConfig, out: Path | None = None, *, resume: Path | None = None, progress: bool = True
) -> tuple[Path, dict]:
    """Train and evaluate; returns (run directory, metrics). Raises ConfigError on bad input
    before writing anything."""
    if resume is not None:
        if not (resume / "config.json").exists():
            raise ConfigError(f"--resume {str(resume)!r}: not a run directory (no config.json)")
        config = RunConfig.from_json((resume / "config.json").read_text())
        run_dir = resume
    config = config.resolved()
    if resume is None:
        run_dir = out or Path("runs") / f"{config.run_name()}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_writable(run_dir)
    rank, world = _distributed()
    if config.batch_size % world:
        raise ConfigError(
            f"batch_size {config.batch_size} is not divisible by the {world} processes"
        )
    torch.manual_seed(config.seed)
    task = _task(config)
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    history: list[dict] = []
    start = 0
    if resume is not None and (run_dir / "state.json").exists():
        state = checkpoints.load(run_dir, model, optimizer)
        start, history = state["epoch"], state["history"]
    elif rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(config.to_json())
    trained = DistributedDataParallel(model) if world > 1 else model
    n = task.n_train()
    steps = n // config.batch_size
    for epoch in range(start, config.epochs):
        model.train()
        # The order depends only on (seed, epoch): a resumed run sees the same batches.
        order = torch.randperm(
            n, generator=torch.Generator().manual_seed(config.seed * 1000 + epoch)
        )
        total = 0.0
        with _progress(steps, f"epoch {epoch + 1}/{config.epochs}", progress and rank == 0) as bar:
            for step in range(steps):
                batch = order[step * config.batch_size : (step + 1) * config.batch_size]
                local = batch.chunk(world)[rank]
                loss = task.loss(trained, local)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()
                total += float(loss.detach())
                bar.set_postfix(loss=f"{total / (step + 1):.4f}")
                bar.update()
        record = {"epoch": epoch + 1, "loss": total / max(steps, 1)}
        if rank == 0:
            val = (
                task.evaluate(model, "validation")
                if "validation" in getattr(task.data, "splits", {})
                else {}
            )
            record.update({f"val_{k}": v for k, v in val.items()})
            history.append(record)
            checkpoints.save(
                run_dir,
                model,
                optimizer,
                {"epoch": epoch + 1, "history": history, "config": asdict(config)},
            )
        if world > 1:
            dist.barrier()
    metrics: dict = {}
    if rank == 0:
        metrics = task.evaluate(model, "test")
        if config.task == "dates":
            unseen = task.evaluate(model, "unseen_patterns")
            metrics["unseen_patterns_exact_match"] = unseen["exact_match"]
        if start >= config.epochs and not history:
            history = []
        checkpoints.atomic_write(
            run_dir / "metrics.json", lambda p: p.write_text(json.dumps(metrics, indent=2))
        )
        write_report(run_dir, asdict(config), metrics, history, task.heatmaps(model))
    if world > 1:
        dist.barrier()
    return run_dir, metrics
