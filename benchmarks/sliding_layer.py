"""A sliding-window layer (a plan's ``sliding:W``, Gemma 2/3's local layers) over a whole
sequence: its window as a block mask (what the layer does) against the dense (N, N) window mask
it built before (the same layer without a window, given the mask that the layer's
``_window_mask`` builds, as its earlier code passed it). Live peak memory and time of one
forward + backward pass.

One :class:`attnkit.TransformerDecoderLayer` (``cross_attention=False``, window W = 512),
B = 1, E = 256, 4 heads (d = 64), feed-forward 1024, float32, 1 thread, no padding; the
backward pass is that of a random linear functional of the output.

Memory: each cell runs in a fresh process whose allocator returns freed memory at once
(:data:`attnkit.benchmarking.memory.LIVE_ALLOCATOR`); the peak is the resident high-water mark
reached during the call, reset just before it (:func:`attnkit.benchmarking.memory.reset_peak`),
minus the resident memory at that point (inputs and parameters excluded). The block-mask cell
includes building the window's block mask (its first call at that length). Time: both run in one
process with the ordinary allocator, interleaved, each first in turn, after one untimed call
each (the block mask is then built and kept, as in training at a fixed length); the median of
the paired ratios block / dense (< 1: the block mask is faster). The outputs and input
gradients of both are compared before timing. Last, the one-off cost of the block mask at each
length: built from the band's geometry (what the layer does) against evaluating the window's
mask function at every pair.

    python benchmarks/sliding_layer.py [--sizes 4096 8192] [--window 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

E, H, FF = 256, 4, 1024


def _setup(which: str, n: int, window: int):
    """One forward + backward call of the layer with its window as ``which`` ("block" or
    "dense")."""
    import torch

    from attnkit.transformer import TransformerDecoderLayer

    torch.manual_seed(0)
    layer = TransformerDecoderLayer(E, H, FF, window=window, cross_attention=False)
    plain = TransformerDecoderLayer(E, H, FF, cross_attention=False)
    plain.load_state_dict(layer.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, E, generator=g).requires_grad_()
    probe = torch.randn(1, n, E, generator=g)

    def call():
        x.grad = None
        if which == "block":
            out = layer(x)
        else:  # the layer's earlier whole-sequence path: its window as a dense (N, N) mask
            out = plain(x, mask=layer._window_mask(n, n, True, x.device))
        (out * probe).sum().backward()
        return out.detach(), x.grad

    return call


def memory_cell(which: str, n: int, window: int) -> dict:
    """One cell, in this process: the live peak (MiB) of one call of ``which``."""
    import torch

    from attnkit.benchmarking.memory import live_peak

    torch.set_num_threads(1)
    _setup(which, 2 * window, window)()  # warm-up at a small size
    call = _setup(which, n, window)
    _, added = live_peak(call)
    return {"peak_mib": added / 2**20}


def memory_table(sizes: list[int], window: int) -> list[str]:
    from attnkit.benchmarking.memory import live_env

    env = live_env({**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [
        "| N | dense mask MiB | block mask MiB | ratio | load |",
        "|---:|---:|---:|---:|---|",
    ]
    for n in sizes:
        cells, load = {}, os.getloadavg()[0]
        for which in ("dense", "block"):
            cmd = [sys.executable, __file__, "--cell", f"{which}:{n}:{window}"]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            cells[which] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
        d, b = cells["dense"], cells["block"]
        lines.append(
            f"| {n} | {d:.1f} | {b:.1f} | **{b / d:.2f}x** | {load:.1f}-{os.getloadavg()[0]:.1f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def time_table(sizes: list[int], window: int, repeats: int) -> list[str]:
    import torch

    from attnkit.benchmarking.timing import interleaved

    torch.set_num_threads(1)
    lines = [
        "| N | dense mask ms | block mask ms | ratio | ratios per round | max diff | load |",
        "|---:|---:|---:|---:|---|---:|---|",
    ]
    for n in sizes:
        calls = {"dense": _setup("dense", n, window), "block": _setup("block", n, window)}
        (out_d, grad_d), (out_b, grad_b) = calls["dense"](), calls["block"]()
        diff = max((out_d - out_b).abs().max().item(), (grad_d - grad_b).abs().max().item())
        load = os.getloadavg()[0]
        times = interleaved(calls, repeats)
        ratios = [b / d for b, d in zip(times["block"], times["dense"], strict=True)]
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        lines.append(
            f"| {n} | {med['dense']:.0f} | {med['block']:.0f} | "
            f"**{statistics.median(ratios):.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} | "
            f"{diff:.1e} | {load:.1f}-{os.getloadavg()[0]:.1f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def build_table(sizes: list[int], window: int) -> list[str]:
    """Building the window's block mask once per length: from its geometry (what the layer
    does) against evaluating its mask function at every pair (``BlockMask.from_mask_mod``)."""
    import torch

    from attnkit.kernels import BlockMask
    from attnkit.transformer.window import window_block_mask, window_pattern

    cpu = torch.device("cpu")
    lines = [
        "| N | every pair ms | geometry ms | ratio | load |",
        "|---:|---:|---:|---:|---|",
    ]
    for n in sizes:
        load = os.getloadavg()[0]
        start = time.perf_counter()
        BlockMask.from_mask_mod(window_pattern(window, True), n, n)
        pairs = time.perf_counter() - start
        window_block_mask.cache_clear()
        start = time.perf_counter()
        window_block_mask(window, n, True, cpu)
        geometry = time.perf_counter() - start
        lines.append(
            f"| {n} | {pairs * 1e3:.0f} | {geometry * 1e3:.0f} | **{geometry / pairs:.3f}x** | "
            f"{load:.1f}-{os.getloadavg()[0]:.1f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        which, n, window = args.cell.split(":")
        print(json.dumps(memory_cell(which, int(n), int(window))))
        return
    import torch

    from attnkit.benchmarking.timing import machine

    torch.set_num_threads(1)
    print(f"Machine: {machine()}; `uptime` at start: {_uptime()}")
    print(
        f"TransformerDecoderLayer, window {args.window}, B = 1, E = {E}, {H} heads, "
        f"feed-forward {FF}, float32, 1 thread, forward + backward\n"
    )
    print("\n".join(memory_table(args.sizes, args.window)) + "\n")
    print("\n".join(time_table(args.sizes, args.window, args.repeats)) + "\n")
    print("\n".join(build_table(args.sizes, args.window)))
    print(f"\n`uptime` at the end: {_uptime()}")


def _uptime() -> str:
    done = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


if __name__ == "__main__":
    main()
