"""Decoding memory per token of context and decoding tokens/s of MHA, GQA, MLA (expanded and
absorbed), StreamingLLM's sinks + window cache and the gated linear-attention family, one
layer, after contexts of 1k to 32k tokens; ratios against MHA in the same run.

    python benchmarks/bench_decode_memory.py [--quick] [--contexts 1024 4096] [--forms mha gqa]
        [--rounds 2]

Each (form, N) cell runs in a fresh process (its peak resident memory is its own); see
:mod:`attnkit.benchmarking.decode_memory`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

from attnkit.benchmarking import decode_memory
from attnkit.benchmarking.timing import machine

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths N")
    parser.add_argument(
        "--forms", nargs="+", default=list(decode_memory.FORMS), choices=decode_memory.FORMS
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every cell; the fastest is shown"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Machine: {machine()}")
    print(f"Date: {datetime.date.today()}; load average at start: {os.getloadavg()}\n")
    report = decode_memory.main(
        args.quick,
        progress=lambda m: print(f"... {m}", file=sys.stderr, flush=True),
        threads=args.threads,
        forms=args.forms,
        contexts=args.contexts,
        timeout=args.timeout,
        rounds=args.rounds,
    )
    print(report)
    print(f"\nLoad average at the end: {os.getloadavg()}")
