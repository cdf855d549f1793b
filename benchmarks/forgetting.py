"""Forgetting attention (FoX) in blocks of query rows against the dense computation that builds
the whole (B, H, N, N) forgetting bias: live peak memory and time.

:class:`attnkit.modern.ForgettingAttention` with ``block_size=256`` (the default) against the same
part with ``block_size=None`` (all rows at once, the dense bias), called as a per-head part on
q, k, v (B = 1, H = 8, d = 64, float32, 1 thread), causal with no mask:

- ``no_grad``: one forward pass;
- ``train``: one forward pass with q, k, v requiring gradients and the backward pass of a
  random linear functional.

Memory: each cell runs in a fresh process whose allocator returns freed memory at once
(:data:`attnkit.benchmarking.memory.LIVE_ALLOCATOR`); the peak is the resident high-water mark
reached during the call, reset just before it (:func:`attnkit.benchmarking.memory.reset_peak`),
minus the resident memory at that point (inputs and parameters excluded). Time: both run in one
process with the ordinary allocator, interleaved, each first in turn; the median of the paired
ratios blocks / dense (≤ 1: the blocks are no slower). Outputs are compared before timing.

    python benchmarks/forgetting.py [--sizes 1024 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

H, D = 8, 64


def _setup(n: int, block: int | None, grad: bool):
    import torch

    from attnkit.modern import ForgettingAttention

    torch.manual_seed(0)
    part = ForgettingAttention(D, H, block_size=block)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_(grad) for _ in range(3))
    probe = torch.randn(1, H, n, D, generator=g)

    def call():
        with torch.set_grad_enabled(grad):
            out = part(q, k, v).context
            if grad:
                (out * probe).sum().backward()
        return out

    return call


def memory_cell(which: str, n: int, grad: bool) -> dict:
    """One cell, in this process: the live peak (MiB) of one call of ``which``."""
    import torch

    from attnkit.benchmarking.memory import live_peak

    torch.set_num_threads(1)
    block = None if which == "dense" else int(which)
    _setup(512, None if block is None else min(block, 256), grad)()  # warm-up: two blocks
    call = _setup(n, block, grad)
    _, added = live_peak(call)
    return {"peak_mib": added / 2**20}


def memory_table(sizes: list[int], block: int) -> list[str]:
    from attnkit.benchmarking.memory import live_env

    env = live_env({**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [
        "| N | case | dense bias MiB | blocks MiB | ratio | load |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for n in sizes:
        for grad in (False, True):
            cells, load = {}, os.getloadavg()[0]
            for which in ("dense", str(block)):
                cmd = [sys.executable, __file__, "--cell", f"{which}:{n}:{int(grad)}"]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                cells[which] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
            d, b = cells["dense"], cells[str(block)]
            lines.append(
                f"| {n} | {'train' if grad else 'no_grad'} | {d:.1f} | {b:.1f} | "
                f"**{b / d:.2f}x** | {load:.1f}-{os.getloadavg()[0]:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def time_table(sizes: list[int], block: int, repeats: int) -> list[str]:
    import torch

    from attnkit.benchmarking.timing import interleaved

    torch.set_num_threads(1)
    lines = [
        "| N | case | dense bias ms | blocks ms | ratio | max diff | load |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for n in sizes:
        for grad in (False, True):
            calls = {"dense": _setup(n, None, grad), "blocks": _setup(n, block, grad)}
            diff = (calls["dense"]() - calls["blocks"]()).abs().max().item()
            load = os.getloadavg()[0]
            times = interleaved(calls, repeats)
            ratio = statistics.median(
                b / d for b, d in zip(times["blocks"], times["dense"], strict=True)
            )
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            lines.append(
                f"| {n} | {'train' if grad else 'no_grad'} | {med['dense']:.0f} | "
                f"{med['blocks']:.0f} | **{ratio:.2f}x** | {diff:.1e} | "
                f"{load:.1f}-{os.getloadavg()[0]:.1f} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        which, n, grad = args.cell.split(":")
        print(json.dumps(memory_cell(which, int(n), bool(int(grad)))))
        return
    import torch

    from attnkit.benchmarking.timing import machine

    torch.set_num_threads(1)
    print(f"Machine: {machine()}; load (1 min) at start {os.getloadavg()[0]:.1f}")
    print(f"B = 1, H = {H}, d = {D}, float32, 1 thread, blocks of {args.block} rows\n")
    print("\n".join(memory_table(args.sizes, args.block)) + "\n")
    print("\n".join(time_table(args.sizes, args.block, args.repeats)))


if __name__ == "__main__":
    main()
