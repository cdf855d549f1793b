"""Decoding tokens/s with the KV cache vs recomputation at contexts 1k and 4k, and the cache's
size with grouped-query / multi-query heads vs standard multi-head attention.

    python benchmarks/bench_decode.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

from attnkit.benchmarking import decode
from attnkit.benchmarking.timing import machine

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    report = decode.main(
        args.quick, progress=lambda m: print(f"... {m}", file=sys.stderr), threads=args.threads
    )
    print(report)
