"""Core benchmark: attnkit's MultiHeadAttention against torch.nn.MultiheadAttention, and each
score function's cost relative to scaled_dot. Forward + backward, float32, CPU.

    python benchmarks/bench_core.py [--quick]

Prints markdown tables of ratios measured in this one run (DESIGN 5).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine, median_seconds

import attnkit as ak


def fwd_bwd(module, x, **kw):
    def step():
        out = module(x, x, x, **kw)
        y = out[0] if isinstance(out, tuple) else out
        y.sum().backward()

    return step


def versus_torch(b: int, n: int, e: int, h: int, min_run_time: float) -> None:
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(e, h, batch_first=True)
    ours = ak.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(b, n, e, requires_grad=True)
    # Alternate ours and theirs twice and keep each one's best median, so that drift in the
    # machine's speed during the run does not favour either side.
    t_ours, t_theirs = float("inf"), float("inf")
    for _ in range(2):
        t_ours = min(t_ours, median_seconds(fwd_bwd(ours, x), min_run_time=min_run_time))
        t_theirs = min(
            t_theirs,
            median_seconds(fwd_bwd(theirs, x, need_weights=False), min_run_time=min_run_time),
        )
    print("\n### MultiHeadAttention (scaled_dot, softmax) vs torch.nn.MultiheadAttention\n")
    print(
        f"B={b}, N={n}, E={e}, heads={h}, float32, forward+backward, self-attention; "
        "torch called with need_weights=False (its fastest path).\n"
    )
    print("| ours (ms) | torch (ms) | ratio ours/torch | target |")
    print("|---:|---:|---:|---:|")
    print(f"| {t_ours * 1e3:.1f} | {t_theirs * 1e3:.1f} | {t_ours / t_theirs:.3f} | <= 1.05 |")


def score_costs(b: int, n: int, e: int, h: int, min_run_time: float) -> None:
    d = e // h
    special = {"location": lambda: ak.scores.Location(d, n, heads=h)}
    x = torch.randn(b, n, e, requires_grad=True)
    rows = []
    for name in ak.scores.available():
        torch.manual_seed(0)
        score = special[name]() if name in special else name
        mha = ak.MultiHeadAttention(e, h, score=score)
        rows.append((name, median_seconds(fwd_bwd(mha, x), min_run_time=min_run_time)))
    base = dict(rows)["scaled_dot"]
    print("\n### Score functions relative to scaled_dot\n")
    print(
        f"MultiHeadAttention, softmax, B={b}, N={n}, E={e}, heads={h} (d={d}; d_w={d} for the "
        "additive family, depth 2 for deep), float32, forward+backward.\n"
    )
    print("| score | time (ms) | ratio to scaled_dot |")
    print("|---|---:|---:|")
    for name, t in sorted(rows, key=lambda r: r[1]):
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, short timing")
    parser.add_argument(
        "--score-batch",
        type=int,
        default=2,
        help="batch size of the per-score table (dense additive scores need O(B·H·N²·d_w) memory)",
    )
    args = parser.parse_args()
    print(f"Machine: {machine()}")
    if args.quick:
        versus_torch(2, 128, 128, 4, 0.5)
        score_costs(1, 64, 64, 4, 0.2)
    else:
        versus_torch(8, 512, 512, 8, 5.0)
        score_costs(args.score_batch, 512, 512, 8, 2.0)


if __name__ == "__main__":
    main()
