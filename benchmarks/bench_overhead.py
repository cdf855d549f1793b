"""Per-call overhead of attnkit's MultiHeadAttention where the work is small and the overhead
dominates: ``MultiHeadAttention(64, 4)`` against ``torch.nn.MultiheadAttention(64, 4)`` with the
same weights, at B = 1 and N = 16, and one cached decoding step.

Cases (float32, CPU, ``--threads`` threads, 1 by default):

- ``forward``: autograd on, need_weights=False for torch;
- ``forward+backward``: the sum of the output, backward to the input and the weights;
- ``eval no_grad``: both in eval mode under ``torch.no_grad()``, where torch takes its native
  fused fast path (``torch._native_multi_head_attention``);
- ``decode step``: one query over a cache of ``--cache`` positions (512 by default) under
  ``no_grad``; torch's layer has no cache, so the baseline is the same step written with torch
  alone (the packed projection, the cache extended by ``torch.cat``, SDPA, the output
  projection).

Each ratio is attnkit's time over the baseline's: the median of per-round ratios, every round
timing a block of calls of each side back to back, so that a change in the machine's load hits
both sides alike. Also printed: the Python frames attnkit enters per call (a ``sys.setprofile``
count of calls into attnkit's own files) and the load average.

    python benchmarks/bench_overhead.py [--threads 1] [--rounds 15] [--calls 200] [--cache 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.benchmarking.timing import machine

E, H, N = 64, 4, 16


def _load() -> float:
    return os.getloadavg()[0]


def frames_per_call(fn: Callable[[], object]) -> int:
    """Python frames entered in attnkit's own files during one call of ``fn``."""
    root = os.path.dirname(ak.__file__)
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(root):
            count += 1

    fn()  # (plans and caches made first)
    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def paired(sides: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict:
    """Per-side median µs per call and the median per-round ratio attnkit / baseline."""
    for fn in sides.values():
        for _ in range(max(10, calls // 10)):
            fn()
    per_call: dict[str, list[float]] = {name: [] for name in sides}
    ratios, loads = [], []
    for _ in range(rounds):
        for name, fn in sides.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - start) / calls * 1e6)
        ratios.append(per_call["attnkit"][-1] / per_call["baseline"][-1])
        loads.append(_load())
    return {
        "us": {name: statistics.median(v) for name, v in per_call.items()},
        "ratio": statistics.median(ratios),
        "load": statistics.median(loads),
    }


def layers() -> tuple[ak.MultiHeadAttention, torch.nn.MultiheadAttention]:
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = ak.MultiHeadAttention.from_torch(theirs)
    return ours, theirs


def cases(cache_len: int) -> dict[str, dict[str, Callable[[], object]]]:
    ours, theirs = layers()
    x = torch.randn(1, N, E, requires_grad=True)

    def fwd_ours():
        return ours(x).context

    def fwd_theirs():
        return theirs(x, x, x, need_weights=False)[0]

    def step(fn):
        return lambda: fn().sum().backward()

    def no_grad(fn, layer):
        def run():
            with torch.no_grad():
                return fn()

        return run

    ours_eval, theirs_eval = layers()
    ours_eval.eval()
    theirs_eval.eval()
    xe = torch.randn(1, N, E)

    # one decoding step over a cache of cache_len positions
    prefix = torch.randn(1, cache_len, E)
    token = torch.randn(1, 1, E)
    with torch.no_grad():
        cache = ak.kv_cache.LayerCache()
        ours_eval(prefix, cache=cache)
    k0, v0 = cache.k, cache.v

    def decode_ours():
        cache.k, cache.v = k0, v0  # the same cache length at every call
        with torch.no_grad():
            return ours_eval(token, cache=cache).context

    w, b = theirs_eval.in_proj_weight, theirs_eval.in_proj_bias
    wo, bo = theirs_eval.out_proj.weight, theirs_eval.out_proj.bias

    def decode_torch():
        with torch.no_grad():
            q, k, v = F.linear(token, w, b).split(E, dim=-1)
            q, k, v = (t.unflatten(-1, (H, E // H)).transpose(1, 2) for t in (q, k, v))
            k, v = torch.cat([k0, k], dim=-2), torch.cat([v0, v], dim=-2)
            out = F.scaled_dot_product_attention(q, k, v)
            return F.linear(out.transpose(1, 2).flatten(-2), wo, bo)

    with torch.no_grad():
        want = decode_torch()
        got = decode_ours()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    with torch.no_grad():
        assert torch.allclose(ours_eval(xe).context, theirs_eval(xe, xe, xe)[0], atol=1e-5)

    return {
        "forward": {"attnkit": fwd_ours, "baseline": fwd_theirs},
        "forward+backward": {"attnkit": step(fwd_ours), "baseline": step(fwd_theirs)},
        "eval no_grad (torch fast path)": {
            "attnkit": no_grad(lambda: ours_eval(xe).context, ours_eval),
            "baseline": no_grad(lambda: theirs_eval(xe, xe, xe, need_weights=False)[0], None),
        },
        f"decode step, cache {cache_len} (torch written out)": {
            "attnkit": decode_ours,
            "baseline": decode_torch,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cache", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Machine: {machine()}; load at start {_load():.1f}\n")
    print(f"MultiHeadAttention({E}, {H}) vs torch, B = 1, N = {N}, float32")
    print("| case | attnkit µs | baseline µs | ratio | attnkit frames | load |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, sides in cases(args.cache).items():
        res = paired(sides, args.rounds, args.calls)
        frames = frames_per_call(sides["attnkit"])
        print(
            f"| {name} | {res['us']['attnkit']:.0f} | {res['us']['baseline']:.0f} | "
            f"{res['ratio']:.2f} | {frames} | {res['load']:.1f} |"
        )


if __name__ == "__main__":
    main()
