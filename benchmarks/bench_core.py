"""Core benchmark: attnkit's MultiHeadAttention against torch.nn.MultiheadAttention, and each
score function's cost relative to scaled_dot. Forward + backward, float32, CPU.

    python benchmarks/bench_core.py [--quick] [--score-batch B]
"""

from __future__ import annotations

import argparse

from attnkit.benchmarking import core
from attnkit.benchmarking.timing import machine

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, short timing")
    parser.add_argument(
        "--score-batch", type=int, default=2, help="batch size of the per-score table"
    )
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(core.main(args.quick, args.score_batch))
