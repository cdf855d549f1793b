"""Chunked kernels against the baselines: dense additive attention, the entmax package,
scaled_dot_product_attention, and the machine's matmul rate.

    python benchmarks/bench_chunked.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

from attnkit.benchmarking import kernels
from attnkit.benchmarking.timing import machine

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(kernels.main(args.quick, progress=lambda m: print(f"... {m}", file=sys.stderr)))
