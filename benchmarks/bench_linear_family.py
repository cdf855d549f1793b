"""Gated linear attention: a training step (forward + backward) in the chunkwise form against
the parallel (quadratic) form, per mechanism and length, one thread by default.

The parallel form materialises the N × N weights (N × N × d_k decays for GLA), so it is skipped
(—) where those would pass --parallel-elements; the chunkwise form costs O(N·C) per head.

    python benchmarks/bench_linear_family.py [--quick] [--sizes 1024 2048 ...] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys

import torch

import attnkit as ak
from attnkit.benchmarking.timing import machine, median_seconds

NAMES = ["retention", "gla", "mamba2", "deltanet", "gated_deltanet"]


def step_seconds(name: str, form: str, n: int, args: argparse.Namespace) -> float:
    """Median seconds of one forward + backward of the part at length ``n``."""
    torch.manual_seed(0)
    part = ak.mechanisms.build(
        name, head_dim=args.head_dim, num_heads=args.heads, form=form, chunk_size=args.chunk
    )
    q, k, v = (
        torch.randn(args.batch, args.heads, n, args.head_dim, requires_grad=True) for _ in range(3)
    )

    def step() -> None:
        part(q, k, v).context.sum().backward()

    return median_seconds(step, min_run_time=args.min_run_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="lengths 256, 512, 1024")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--names", nargs="+", default=NAMES, choices=NAMES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument(
        "--parallel-elements", type=int, default=2**26, help="largest parallel form (N² or N²d)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-run-time", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [256, 512, 1024] if args.quick else args.sizes
    print(f"Machine: {machine()}")
    print(
        f"B={args.batch}, H={args.heads}, d={args.head_dim}, chunk={args.chunk}, float32, "
        "forward + backward\n"
    )
    print("| mechanism | N | parallel (ms) | chunkwise (ms) | parallel / chunkwise |")
    print("|---|---:|---:|---:|---:|")
    for name in args.names:
        for n in sizes:
            print(f"... {name} N={n}", file=sys.stderr)
            chunk = step_seconds(name, "chunkwise", n, args)
            if n * n * (args.head_dim if name == "gla" else 1) <= args.parallel_elements:
                par = step_seconds(name, "parallel", n, args)
                cells = f"{par * 1e3:.1f} | {chunk * 1e3:.1f} | {par / chunk:.2f}"
            else:
                cells = f"— | {chunk * 1e3:.1f} | —"
            print(f"| {name} | {n} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
