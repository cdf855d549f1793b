"""Training throughput alone vs with one competing busy process, in the same run.

A training step of the dates task (the model and batch of ``attnkit run dates``) is timed with
torch.utils.benchmark, first alone, then while another process spins on one core. The thread
count ``attnkit run`` chooses by itself (auto) is compared with torch's default (one thread per
core). The target: loaded throughput at least 0.6x the alone throughput for the auto choice.

    python benchmarks/bench_contention.py [--seconds S] [--append]

``--append`` adds the table, with the machine, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils import benchmark

from attnkit import tasks
from attnkit.benchmarking.timing import machine
from attnkit.experiments.config import RunConfig
from attnkit.experiments.threads import choose_threads, count_flops, usable_cores

BUSY = "while True: pass"


def training_step(config: RunConfig):
    """A closure that runs one optimiser step on the next batch, and the task's flop count."""
    torch.manual_seed(0)
    task = tasks.get(config.task)(config)
    model = task.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    n, b = task.n_train(), config.batch_size
    state = {"i": 0}

    def step() -> None:
        start = state["i"] % (n // b) * b
        state["i"] += 1
        loss = task.loss(model, torch.arange(start, start + b))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()

    flops = count_flops(lambda: task.loss(model, torch.arange(b)))
    return step, flops


def steps_per_second(step, threads: int, seconds: float) -> float:
    step()  # warm-up
    timer = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=threads)
    return 1.0 / timer.blocked_autorange(min_run_time=seconds).median


def measure(step, threads: int, seconds: float) -> tuple[float, float]:
    alone = steps_per_second(step, threads, seconds)
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.5)  # let the competitor get going
        loaded = steps_per_second(step, threads, seconds)
    finally:
        busy.kill()
        busy.wait()
    return alone, loaded


def main(seconds: float) -> str:
    config = RunConfig(task="dates", quick=True, n_train=640, n_test=16).resolved()
    step, flops = training_step(config)
    auto, why = choose_threads(None, flops)
    cores = usable_cores()
    rows = [
        "| configuration | alone (steps/s) | with one busy process (steps/s) | loaded / alone |",
        "|---|---|---|---|",
    ]
    for label, threads in ((f"auto: {auto} thread(s)", auto), (f"torch default: {cores}", cores)):
        alone, loaded = measure(step, threads, seconds)
        rows.append(f"| {label} | {alone:.1f} | {loaded:.1f} | {loaded / alone:.2f} |")
    head = (
        f"dates training step (batch {config.batch_size}, d_model {config.d_model}, "
        f"{flops / 1e6:.0f} MFLOP forward); auto choice: {why}"
    )
    return head + "\n\n" + "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="timing per measurement")
    parser.add_argument("--append", action="store_true", help="add the result to RESULTS.md")
    args = parser.parse_args()
    where = f"Machine: {machine()}; {usable_cores()} usable cores"
    table = main(args.seconds)
    print(f"{where}\n\n{table}")
    if args.append:
        results = Path(__file__).with_name("RESULTS.md")
        with results.open("a", encoding="utf-8") as f:
            f.write(
                f"\n## Contention: `benchmarks/bench_contention.py` ({dt.date.today()})\n\n"
                f"{where}\n\n{table}\n"
            )
