"""Native sparse attention (NSA) and DeepSeek sparse attention (DSA) against causal SDPA: forward
and forward + backward time, paired in one process, and peak memory, each case in a fresh
process. The parts run at their papers' defaults (NSA: l = 32, s = 16, l' = 64, n = 16, w = 512;
DSA: top-k = 2048, the indexer's defaults), per head on q, k, v (1, H, N, d).

Time: the three cases are built once per N in one process and their steps interleaved (SDPA,
NSA, DSA, SDPA, ...), ``--repeats`` rounds; the table gives each case's median and the ratio of
medians to SDPA. The forward runs without autograd (inference); forward + backward sums the
output and back-propagates to q, k, v and the parameters.

Memory: one fresh process per (case, N, step), started with glibc set to return freed memory
(the live peak, not what the allocator keeps); a warm-up step at N/4, then the step's peak
resident memory above the resident memory before it (high-water mark reset).

    python benchmarks/bench_trainable_sparse.py [--n 4096,8192,16384] [--repeats 5]
        [--cases sdpa,nsa,dsa] [--threads 1] [--no-memory] [--counts]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.benchmarking.memory import live_peak
from attnkit.benchmarking.timing import machine
from attnkit.sparse_trainable import DeepSeekSparseAttention, NativeSparseAttention

MiB = float(1 << 20)
H, D = 4, 64
#: glibc settings under which freed memory is returned at once (read at process start)
LIVE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _case(name: str, n: int, seed: int = 0) -> tuple[Callable[[], Tensor], list[Tensor]]:
    """The case's forward (a closure) and the leaves whose gradients a step clears."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_() for _ in range(3))
    if name == "sdpa":
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [q, k, v]
    torch.manual_seed(seed)
    part = {"nsa": NativeSparseAttention, "dsa": DeepSeekSparseAttention}[name](D)
    return (lambda: part(q, k, v).context), [q, k, v, *part.parameters()]


def _forward(forward: Callable[[], Tensor], leaves: list[Tensor]) -> None:
    with torch.no_grad():
        forward()


def _step(forward: Callable[[], Tensor], leaves: list[Tensor]) -> None:
    forward().sum().backward()
    for x in leaves:
        x.grad = None


STEPS = {"forward": _forward, "forward+backward": _step}


def times(names: list[str], n: int, repeats: int) -> dict[tuple[str, str], float]:
    """Median seconds of every (case, step) at N, interleaved in this process."""
    cases = {name: _case(name, n) for name in names}
    for name in names:  # warm-up
        for step in STEPS.values():
            step(*cases[name])
    seen: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for step_name, step in STEPS.items():
            for name in names:
                start = time.perf_counter()
                step(*cases[name])
                seen.setdefault((name, step_name), []).append(time.perf_counter() - start)
    return {key: statistics.median(value) for key, value in seen.items()}


def nsa_counts(n: int) -> dict[str, float]:
    """Keys NSA's fused path scores per query, by piece, at N (one head of random inputs, the
    papers' defaults), each costing 4·d flops (q·k and p·v) as a key of causal SDPA does
    (SDPA scores (N + 1)/2 keys per query on average)."""
    from attnkit.sparse_trainable import _nsa_blocks as nb

    part = NativeSparseAttention(D)
    sz = part._sizes()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, D, generator=g) for _ in range(3))
    with torch.no_grad():
        kc, vc = part._compress(k, v, None, torch.arange(n))
        gates = torch.sigmoid(part.gate(q))
        chosen = torch.empty(n, sz.selected, dtype=torch.int16)
        items = [(q[0, 0], k[0, 0], v[0, 0], kc[0, 0], vc[0, 0], gates[0, 0],
                  torch.empty(n, D), torch.empty(3, n), chosen)]  # fmt: skip
        geo = nb._Geometry(n, n, 0, sz)
        nb._forward_group(items, geo, D**-0.5)
    counts = {"compressed": 0.0, "selected, forced blocks": 0.0, "window": 0.0}
    for a, b in nb._chunks(geo, kc.shape[-2]):
        counts["compressed"] += (b - a) * min(kc.shape[-2], max(0, (b - 1 - 31) // 16 + 1))
        for piece in nb._pieces(geo, a // 64, -(-b // 64), torch.float32, "cpu"):
            r0, r1 = piece.span(geo)
            name = "selected, forced blocks" if "slc" in piece.branches else "window"
            counts[name] += (r1 - r0) * piece.length
    tiles = nb._Tiles(chosen, geo)
    counts["selected, gathered tiles"] = len(tiles.query) * 64
    counts["(of which unused slots)"] = int((tiles.query == n).sum()) * 64
    return {key: value / n for key, value in counts.items()}


def cell(name: str, n: int, step_name: str, threads: int) -> dict:
    """Peak bytes of one step above the resident memory before it, in this process."""
    torch.set_num_threads(threads)
    STEPS[step_name](*_case(name, max(64, n // 4)))  # one-time costs
    forward, leaves = _case(name, n)
    _, added = live_peak(lambda: STEPS[step_name](forward, leaves))
    return {"added": added}


def run_cell(name: str, n: int, step_name: str, threads: int) -> float | None:
    cmd = [sys.executable, __file__, "--cell", json.dumps([name, n, step_name, threads])]
    env = {**os.environ, **LIVE_ALLOCATOR, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        print(proc.stderr.strip().splitlines()[-1:], file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["added"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", default="4096,8192,16384")
    parser.add_argument("--cases", default="sdpa,nsa,dsa")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--counts", action="store_true", help="print NSA's scored keys")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(*json.loads(args.cell))))
        return
    torch.set_num_threads(args.threads)
    if args.counts:
        print("| N | SDPA | " + " | ".join(nsa_counts(64 * 16)) + " | NSA / SDPA |")
        for n in (int(x) for x in args.n.split(",")):
            c = nsa_counts(n)
            scored = sum(v for key, v in c.items() if not key.startswith("("))
            row = " | ".join(f"{v:.0f}" for v in c.values())
            print(f"| {n} | {(n + 1) / 2:.0f} | {row} | {scored / ((n + 1) / 2):.2f} |")
        return
    names = args.cases.split(",")
    others = [x for x in names if x != "sdpa"]
    load = os.getloadavg()
    print(f"Machine: {machine()}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"(1, {H}, N, {D}) float32, median of {args.repeats} interleaved rounds\n")
    print(
        "| N | step | SDPA ms | "
        + " | ".join(f"{x.upper()} ms | {x.upper()} / SDPA" for x in others)
        + " |\n|---:|---|---:|"
        + "---:|---:|" * len(others)
    )
    for n in (int(x) for x in args.n.split(",")):
        got = times(names, n, args.repeats)
        for step_name in STEPS:
            base = got[("sdpa", step_name)]
            row = " | ".join(
                f"{got[(x, step_name)] * 1e3:.0f} | {got[(x, step_name)] / base:.2f}"
                for x in others
            )
            print(f"| {n} | {step_name} | {base * 1e3:.0f} | {row} |", flush=True)
    load = os.getloadavg()
    print(f"\nload average after timing: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.no_memory:
        return
    print(
        "\nPeak memory above the step's start (MiB), fresh process per cell\n\n| N | step | "
        + " | ".join(x.upper() for x in names)
        + " |\n|---:|---|"
        + "---:|" * len(names)
    )
    for n in (int(x) for x in args.n.split(",")):
        for step_name in STEPS:
            cells = [run_cell(x, n, step_name, args.threads) for x in names]
            text = " | ".join("failed" if c is None else f"{c / MiB:.1f}" for c in cells)
            print(f"| {n} | {step_name} | {text} |", flush=True)


if __name__ == "__main__":
    main()
