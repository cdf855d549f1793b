"""Block-sparse attention: does the cost follow the pattern's density?

Forward + backward of softmax attention for sliding window, BigBird and Sparse Transformer
strided patterns, three ways (block-sparse, the same mask through every tile, unmasked), each in
a fresh process; the ratio block-sparse time / (density × unmasked time), target ≤ 1.5. See
:mod:`attnkit.benchmarking.sparse` (also ``attnkit bench sparse``).

    python benchmarks/bench_sparse.py [--quick] [--threads T] [--sizes 4096,16384,65536]
"""

from __future__ import annotations

import argparse
import sys

from attnkit.benchmarking import sparse
from attnkit.benchmarking.timing import machine

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 1k and 4k, one repeat")
    parser.add_argument("--threads", type=int, help="torch threads in each case (default: torch's)")
    parser.add_argument("--sizes", help="comma-separated N (default 4096,16384)")
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(
        sparse.main(
            args.quick,
            args.threads,
            [int(n) for n in args.sizes.split(",")] if args.sizes else None,
            progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True),
        )
    )
