"""Efficient (linear, kernelized, low-rank) attention against exact attention as N grows:
forward+backward time and peak memory (fresh process per cell) for N = 1k … 32k (B=1, H=4,
d=64, float32, CPU), log-log slopes, the crossover N, ratios against exact chunked softmax
attention at N = 16k, and a log-log plot of time against N.

Contestants: exact attention (SDPA and attnkit's chunked kernel) and every registered
attention-slot mechanism of attnkit.efficient, by registry name (or --mechanisms a,b,c).

    python benchmarks/bench_efficient.py [--quick] [--sizes 1024,2048] [--mechanisms linear,rfa]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnkit.benchmarking import efficient
from attnkit.benchmarking.timing import machine

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 256, 512, 1024, one repeat")
    parser.add_argument("--sizes", help="comma-separated N (default: 1024 … 32768)")
    parser.add_argument("--mechanisms", help="comma-separated registered names")
    parser.add_argument(
        "--budget", type=float, default=120.0, help="seconds per call beyond which larger N "
        "is not run for that contestant (default 120)"
    )  # fmt: skip
    parser.add_argument(
        "--plot", default=str(Path(__file__).with_name("efficient.png")), help="PNG path"
    )
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(
        efficient.main(
            args.quick,
            args.mechanisms.split(",") if args.mechanisms else None,
            [int(n) for n in args.sizes.split(",")] if args.sizes else None,
            budget=args.budget,
            plot_path=args.plot,
            progress=lambda m: print(f"... {m}", file=sys.stderr, flush=True),
        )
    )
