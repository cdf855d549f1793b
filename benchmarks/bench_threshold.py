"""Where Newton's method starts on the α-entmax threshold in the chunked kernel: from the
threshold of each row's top-64 scores (kept in the first sweep) against from max − 1 (the
single largest score), same inputs, same run. Each Newton step is a sweep over the keys.

    python benchmarks/bench_threshold.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils import benchmark

import attnkit as ak
from attnkit.alignments import sparse
from attnkit.benchmarking.timing import machine


def main(quick: bool) -> str:
    n = 1024 if quick else 4096
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, n, 64) for _ in range(3))
    rows = [
        f"chunked forward, B=1, M=N={n}, d=64, float32, chunk_size=512, "
        f"{torch.get_num_threads()} threads",
        "",
        "| alignment | start max−1 (ms) | start top-64 (ms) | ratio | max |Δ| vs dense |",
        "|---|---:|---:|---:|---:|",
    ]
    for align in ("sparsemax", "entmax15", "entmax"):
        part = ak.alignments.Entmax(1.25) if align == "entmax" else align
        times = {}
        for top in (1, 64):
            sparse._TOP = top
            timer = benchmark.Timer(
                "ak.attention(q, k, v, align=part, chunk_size=512)",
                globals={"ak": ak, "q": q, "k": k, "v": v, "part": part},
            )
            times[top] = timer.blocked_autorange(min_run_time=1.0).median * 1e3
        out = ak.attention(q, k, v, align=part, chunk_size=512).context
        ref = ak.attention(q, k, v, align=part, kernel="dense").context
        err = float((out - ref).abs().max())
        label = "entmax (α=1.25)" if align == "entmax" else align
        rows.append(
            f"| {label} | {times[1]:.1f} | {times[64]:.1f} | {times[1] / times[64]:.2f} | "
            f"{err:.1e} |"
        )
    sparse._TOP = 64
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 1024 instead of 4096")
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(main(args.quick))
