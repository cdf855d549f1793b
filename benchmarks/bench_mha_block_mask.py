"""Multi-head attention with a sparse pattern: does the cost follow the density?

``MultiHeadAttention(E, H)`` (E = 256, H = 4, float32, B = 1) on N tokens, timed in one process
(median of repeats after a warm-up), four ways for each sliding window:

- block mask: ``mha(x, block_mask=patterns.block_mask(sliding_window(w), N))``;
- auto: ``mha(x, mask=masks.window(N, N, w))``, the dense boolean mask, which attnkit turns into a
  block mask itself when most of its tiles are empty (see ``attnkit.kernels.block_mask``);
- dense mask: the same dense mask with the automatic conversion switched off (SDPA with a
  boolean mask: every tile is computed);
- unmasked: no mask at all (SDPA).

Ratios: time / (density × unmasked time), where density is the share of 128 × 128 tiles the
block mask visits (≈ 1 means the cost follows the density), and dense-mask time / auto time.

    python benchmarks/bench_mha_block_mask.py [--n 8192] [--windows 128,512,2048]
        [--threads 1] [--forward-only] [--repeats 3] [--paired]

``--paired`` times unmasked, block mask and auto interleaved (unmasked, block, auto, then the
reverse order, ``--repeats`` rounds after a warm-up) and reports the median of the per-round
ratios time / (density × unmasked time), which a machine shared with other jobs moves less than
a ratio of medians taken minutes apart. The dense-mask column is left out there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import attnkit as ak
from attnkit import patterns as pt
from attnkit.benchmarking.timing import machine, measure_step
from attnkit.kernels import block_mask as bmm


def _step(mha, x, backward: bool, **kw):
    def run():
        if backward:
            x.grad = None
            mha(x, **kw).context.sum().backward()
        else:
            with torch.no_grad():
                mha(x, **kw)

    return run


def _paired(mha, x, n: int, windows: list[int], passes: list[bool], repeats: int) -> None:
    """Unmasked, block mask and auto interleaved per round; medians of per-round ratios."""
    print(
        "| window | pass | density | block mask (s) | auto (s) | unmasked (s) "
        "| block mask / (density × unmasked) | auto / (density × unmasked) | load |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for backward in passes:
        for w in windows:
            bm = pt.block_mask(pt.sliding_window(w), n)
            auto_mask = ak.masks.window(n, n, w)
            steps = {
                "unmasked": _step(mha, x, backward),
                "block": _step(mha, x, backward, block_mask=bm),
                "auto": _step(mha, x, backward, mask=auto_mask),
            }
            for run in steps.values():
                run()
            times: dict[str, list[float]] = {name: [] for name in steps}
            for i in range(repeats):
                order = list(steps) if i % 2 == 0 else list(steps)[::-1]
                for name in order:
                    start = time.perf_counter()
                    steps[name]()
                    times[name].append(time.perf_counter() - start)
            d = bm.density
            ratio = {
                name: statistics.median(
                    t / (d * u) for t, u in zip(times[name], times["unmasked"], strict=True)
                )
                for name in ("block", "auto")
            }
            med = {name: statistics.median(t) for name, t in times.items()}
            print(
                f"| {w} | {'fwd+bwd' if backward else 'fwd'} | {d:.3f} | {med['block']:.3f} | "
                f"{med['auto']:.3f} | {med['unmasked']:.3f} | {ratio['block']:.2f} | "
                f"{ratio['auto']:.2f} | {os.getloadavg()[0]:.1f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--windows", default="128,512,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--paired", action="store_true", help="interleaved, no dense mask")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, e, h = args.n, 256, 4
    mha = ak.MultiHeadAttention(e, h)
    x = torch.randn(1, n, e, requires_grad=True)
    passes = [False] if args.forward_only else [False, True]
    load = os.getloadavg()[0]
    print(f"Machine: {machine()}; load average {load:.1f} at the start\n")
    print(f"MultiHeadAttention(E={e}, H={h}), B=1, N={n}, float32, blocks 128 x 128\n")
    if args.paired:
        windows = [int(s) for s in args.windows.split(",")]
        _paired(mha, x, n, windows, passes, args.repeats)
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
        return
    print(
        "| window | pass | density | block mask (s) | auto (s) | dense mask (s) | unmasked (s) "
        "| block mask / (density × unmasked) | auto / (density × unmasked) "
        "| dense mask / auto |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for backward in passes:
        unmasked = measure_step(_step(mha, x, backward), args.repeats)["seconds"]
        for w in (int(s) for s in args.windows.split(",")):
            bm = pt.block_mask(pt.sliding_window(w), n)
            auto_mask = ak.masks.window(n, n, w)
            times = {
                "block": measure_step(_step(mha, x, backward, block_mask=bm), args.repeats),
                "auto": measure_step(_step(mha, x, backward, mask=auto_mask), args.repeats),
            }
            saved, bmm.AUTO_MAX_DENSITY = bmm.AUTO_MAX_DENSITY, -1.0  # conversion off
            try:
                plain_mask = ak.masks.window(n, n, w)  # (its own cache entry)
                times["dense"] = measure_step(
                    _step(mha, x, backward, mask=plain_mask), args.repeats
                )
            finally:
                bmm.AUTO_MAX_DENSITY = saved
            t = {k: v["seconds"] for k, v in times.items()}
            d = bm.density
            print(
                f"| {w} | {'fwd+bwd' if backward else 'fwd'} | {d:.3f} | {t['block']:.3f} | "
                f"{t['auto']:.3f} | {t['dense']:.3f} | {unmasked:.3f} | "
                f"{t['block'] / (d * unmasked):.2f} | {t['auto'] / (d * unmasked):.2f} | "
                f"{t['dense'] / t['auto']:.2f} |",
                flush=True,
            )
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
