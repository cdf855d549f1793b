"""Block-sparse attention: does the cost follow the pattern's density? (Soydaner 5.1)

For each sparse pattern (sliding window, BigBird, Sparse Transformer strided) at each N, forward +
backward of softmax attention (B=1, d=64, float32) three ways, each in a fresh process
(``python -m attnkit.benchmarking.sparse '<json>'``; time = median of repeats after a warm-up,
peak = the process's peak resident memory, base = that peak before the first call):

- block-sparse: ``ak.attention(..., block_mask=...)`` — empty tiles skipped, full tiles unmasked;
- dense-tile: the same pattern as a boolean (N, N) mask through the chunked kernel, which
  computes every tile and masks it;
- unmasked: exact attention with no mask through the chunked kernel.

The target ratio is block-sparse time / (density × unmasked time) ≤ 1.5, where density is the
share of tiles the block mask visits: the cost follows the density. Memory above base should
grow as O(N) for block-sparse (it never forms N × N).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from attnkit.benchmarking.timing import in_subprocess, measure_step

__all__ = ["BLOCK", "PATTERNS", "main", "run_case", "sizes_for"]

BLOCK = 128
MiB = float(1 << 20)


def _pattern(name: str, n: int):
    from attnkit import patterns as pt

    if name == "window 256":
        return pt.sliding_window(256)
    if name == "BigBird":
        return pt.bigbird(128, n, global_positions=[0], random_blocks=2, block=BLOCK)
    if name == "strided 128, causal":
        return pt.strided(128)
    raise ValueError(f"unknown pattern {name!r}; one of {PATTERNS}")


PATTERNS = ("window 256", "BigBird", "strided 128, causal")
DESCRIPTION = {
    "window 256": "sliding window 256",
    "BigBird": "BigBird (window 128, 1 global, 2 random blocks)",
    "strided 128, causal": "strided 128, causal (Sparse Transformer)",
}


def run_case(case: dict) -> dict:
    """One configuration in this process: ``{"way", "n", "pattern"?, "repeats", "threads"?,
    "d"?}`` with way ``block-sparse``, ``dense-tile`` or ``unmasked``."""
    import attnkit as ak
    from attnkit import patterns as pt

    torch.manual_seed(0)
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    n, d = case["n"], case.get("d", 64)
    q, k, v = (torch.randn(1, n, d, requires_grad=True) for _ in range(3))
    kwargs: dict = {"chunk_size": BLOCK}
    density = 1.0
    way = case["way"]
    if way == "block-sparse":
        bm = pt.block_mask(_pattern(case["pattern"], n), n, block_q=BLOCK, block_k=BLOCK)
        kwargs, density = {"block_mask": bm}, bm.density
    elif way == "dense-tile":
        kwargs["mask"] = pt.dense(_pattern(case["pattern"], n), n, n)
    elif way != "unmasked":
        raise ValueError(f"unknown way {way!r}: block-sparse, dense-tile or unmasked")

    def step():
        ak.attention(q, k, v, kernel="chunked", **kwargs).context.sum().backward()
        for x in (q, k, v):
            x.grad = None

    return {**measure_step(step, case.get("repeats", 1)), "density": density}


def _above_base(result: dict) -> str:
    return f"{(result['peak_bytes'] - result['base_bytes']) / MiB:.0f}"


def _in_subprocess(case: dict) -> dict:
    return in_subprocess(case, module="attnkit.benchmarking.sparse")


def sizes_for(quick: bool) -> list[int]:
    """The default N: 1k and 4k when quick, else 4k and 16k (64k on request: ``sizes``)."""
    return [1024, 4096] if quick else [4096, 16384]


def main(
    quick: bool = False,
    threads: int | None = None,
    sizes: list[int] | None = None,
    *,
    dense_tile_up_to: int = 16384,
    progress: Callable[[str], None] = lambda msg: None,
    in_process: bool = False,
) -> str:
    """Run the benchmark and return its markdown table. The dense-tile way forms an N × N
    boolean mask, so it is skipped above ``dense_tile_up_to``."""
    sizes = sizes or sizes_for(quick)
    repeats = 1 if quick else 2
    shown = threads or torch.get_num_threads()
    measure = run_case if in_process else _in_subprocess
    rows = [
        f"softmax, B=1, d=64, float32, forward+backward, blocks {BLOCK}×{BLOCK}, "
        f"{shown} thread(s); memory = peak resident above the process's base",
        "",
        "| pattern | N | density | block-sparse (s) | dense-tile (s) | unmasked (s) | "
        "block-sparse / (density × unmasked) | memory block-sparse / dense-tile (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        common = {"n": n, "repeats": repeats, "threads": threads}
        progress(f"N={n}: unmasked")
        unmasked = measure({**common, "way": "unmasked"})
        for name in PATTERNS:
            progress(f"N={n}: {name}")
            sparse = measure({**common, "way": "block-sparse", "pattern": name})
            tile = (
                measure({**common, "way": "dense-tile", "pattern": name})
                if n <= dense_tile_up_to
                else None
            )
            failed = [r for r in (unmasked, sparse, tile) if r is not None and "error" in r]
            if failed:
                rows.append(f"| {DESCRIPTION[name]} | {n} | failed: {failed[0]['error']} |")
                continue
            expected = sparse["density"] * unmasked["seconds"]
            ratio = f"{sparse['seconds'] / expected:.2f}" if expected > 0 else "n/a"
            tile_time = f"{tile['seconds']:.3g}" if tile else "not run (N × N mask)"
            rows.append(
                f"| {DESCRIPTION[name]} | {n} | {sparse['density']:.3f} | "
                f"{sparse['seconds']:.3g} | {tile_time} | {unmasked['seconds']:.3g} | "
                f"{ratio} | {_above_base(sparse)} / {_above_base(tile) if tile else '-'} |"
            )
            progress(rows[-1])
    return "\n".join(rows)


if __name__ == "__main__":
    print(json.dumps(run_case(json.loads(sys.argv[1]))))
