"""Chunked kernels against the baselines: dense additive attention, the entmax package,
scaled_dot_product_attention, and the machine's matmul rate.

``--window-memory`` instead measures the live peak memory of one forward pass of the
sliding-window function (:func:`attnkit.efficient.sliding_window.sliding_window_attention`,
window 256) against ``F.scaled_dot_product_attention`` over the whole sequence (no mask), at
B = 1, H = 8, d = 64, float32, 1 thread: with the inputs requiring gradients (what a training
forward keeps) and under ``no_grad``. Each cell runs in a fresh process whose allocator returns
freed memory at once (:data:`attnkit.benchmarking.memory.LIVE_ALLOCATOR`); the peak is the
resident high-water mark after the inputs are made, reset just before the call
(:func:`attnkit.benchmarking.memory.reset_peak`), minus the resident memory at that point.

    python benchmarks/bench_chunked.py [--quick]
    python benchmarks/bench_chunked.py --window-memory [--sizes 16384,32768] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

H, D, WINDOW = 8, 64, 256


def window_cell(which: str, n: int, grad: bool) -> dict:
    """One cell, in this process: the live peak (MiB) of one forward of ``which``."""
    import torch

    from attnkit.benchmarking.memory import reset_peak, status
    from attnkit.efficient.sliding_window import sliding_window_attention

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_(grad) for _ in range(3))
    if which == "window":
        sliding_window_attention(q[..., :512, :], k[..., :512, :], v[..., :512, :], WINDOW)
    else:
        torch.nn.functional.scaled_dot_product_attention(*(x[..., :512, :] for x in (q, k, v)))
    reset_peak()
    before = status("VmRSS")
    with torch.set_grad_enabled(grad):
        if which == "window":
            out = sliding_window_attention(q, k, v, WINDOW)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    peak = status("VmHWM")
    del out
    return {"peak_mib": (peak - before) / 2**20, "output_mib": n * H * D * 4 / 2**20}


def window_memory(sizes: list[int], rounds: int) -> str:
    from attnkit.benchmarking.memory import live_env

    env = live_env({**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [
        "| N | forward | round | sliding window MiB | SDPA MiB | ratio | output MiB | load |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for n in sizes:
        for grad in (True, False):
            for r in range(rounds):
                cells = {}
                load = os.getloadavg()[0]
                for which in ("window", "sdpa"):
                    cmd = [sys.executable, __file__, "--cell", f"{which}:{n}:{int(grad)}"]
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                    cells[which] = json.loads(done.stdout.strip().splitlines()[-1])
                w, s = cells["window"]["peak_mib"], cells["sdpa"]["peak_mib"]
                lines.append(
                    f"| {n} | {'with grad' if grad else 'no_grad'} | {r + 1} | {w:.1f} | {s:.1f} "
                    f"| **{w / s:.2f}x** | {cells['sdpa']['output_mib']:.1f} "
                    f"| {load:.1f}-{os.getloadavg()[0]:.1f} |"
                )
                print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--window-memory", action="store_true", help="sliding window vs SDPA")
    parser.add_argument("--sizes", default="16384,32768", help="N for --window-memory")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of each memory cell")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # which:N:grad, in this process
    args = parser.parse_args()
    if args.cell:
        which, n, grad = args.cell.split(":")
        print(json.dumps(window_cell(which, int(n), grad == "1")))
        sys.exit(0)

    from attnkit.benchmarking.timing import machine

    print(f"Machine: {machine()}\n")
    if args.window_memory:
        print(window_memory([int(s) for s in args.sizes.split(",")], args.rounds))
        sys.exit(0)
    from attnkit.benchmarking import kernels

    print(kernels.main(args.quick, progress=lambda m: print(f"... {m}", file=sys.stderr)))
