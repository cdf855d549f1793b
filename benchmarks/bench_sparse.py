"""Block-sparse attention: does the cost follow the pattern's density?

For each sparse pattern (sliding window, BigBird, Sparse Transformer strided) at each N, forward +
backward of softmax attention (B=1, d=64, float32) three ways, each in a fresh process (time =
median of repeats after a warm-up; peak = the process's peak resident memory):

- block-sparse: ``ak.attention(..., block_mask=...)`` — empty tiles skipped;
- dense-tile: the same pattern as a boolean (N, N) mask through the chunked kernel, which visits
  every tile;
- unmasked: exact attention with no mask through the chunked kernel.

The target ratio is block-sparse time / (density × unmasked time) ≤ 1.5, where density is the
share of tiles the block mask visits.

    python benchmarks/bench_sparse.py [--quick] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

import attnkit as ak
from attnkit import patterns as pt
from attnkit.benchmarking.timing import machine

BLOCK = 128
PATTERNS = {
    "window 256": lambda n: pt.sliding_window(256),
    "BigBird (window 128, 1 global, 2 random blocks)": lambda n: pt.bigbird(
        128, n, global_positions=[0], random_blocks=2, block=BLOCK
    ),
    "strided 128, causal": lambda n: pt.strided(128),
}


def run_case(case: dict) -> dict:
    torch.manual_seed(0)
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    n = case["n"]
    q, k, v = (torch.randn(1, n, 64, requires_grad=True) for _ in range(3))
    kwargs: dict = {}
    density = 1.0
    if case["way"] != "unmasked":
        mod = PATTERNS[case["pattern"]](n)
        if case["way"] == "block-sparse":
            bm = pt.block_mask(mod, n, block_q=BLOCK, block_k=BLOCK)
            kwargs, density = {"block_mask": bm}, bm.density
        else:
            kwargs = {"mask": pt.dense(mod, n, n), "chunk_size": BLOCK}
    else:
        kwargs = {"chunk_size": BLOCK}

    def step():
        out = ak.attention(q, k, v, kernel="chunked", **kwargs).context
        out.sum().backward()

    step()
    times = []
    for _ in range(case["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": times[len(times) // 2], "peak": peak, "density": density}


def in_process(case: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(case)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(quick: bool, threads: int | None) -> str:
    sizes = [1024, 4096] if quick else [4096, 16384]
    repeats = 1 if quick else 2
    shown = threads or torch.get_num_threads()
    rows = [
        f"softmax, B=1, d=64, float32, forward+backward, blocks {BLOCK}×{BLOCK}, "
        f"{shown} thread(s); peak = whole-process resident memory",
        "",
        "| pattern | N | density | block-sparse (s) | dense-tile (s) | unmasked (s) | "
        "block-sparse / (density × unmasked) | peak block-sparse / dense-tile (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        common = {"n": n, "repeats": repeats, "threads": threads}
        unmasked = in_process({**common, "way": "unmasked"})
        for name in PATTERNS:
            sparse = in_process({**common, "way": "block-sparse", "pattern": name})
            tile = in_process({**common, "way": "dense-tile", "pattern": name})
            if any("error" in r for r in (unmasked, sparse, tile)):
                rows.append(f"| {name} | {n} | failed: {unmasked, sparse, tile} |")
                continue
            ratio = sparse["seconds"] / (sparse["density"] * unmasked["seconds"])
            rows.append(
                f"| {name} | {n} | {sparse['density']:.3f} | {sparse['seconds']:.2f} | "
                f"{tile['seconds']:.2f} | {unmasked['seconds']:.2f} | {ratio:.2f} | "
                f"{sparse['peak'] / 2**20:.0f} / {tile['peak'] / 2**20:.0f} |"
            )
            print(rows[-1], file=sys.stderr)
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 1k and 4k, one repeat")
    parser.add_argument("--threads", type=int, help="torch threads in each case (default: torch's)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
    else:
        print(f"Machine: {machine()}\n")
        print(main(args.quick, args.threads))
