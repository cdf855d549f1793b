"""The cost claims of the efficient mechanisms' docstrings, measured: forward + backward time and
peak memory at N and 4N for the claims that no other benchmark covers (see RESULTS.md, "Cost
claims of the docstrings"). A cost linear in N gives ratios near 4, a quadratic one near 16.

Each (case, N) runs in a fresh Python process: one warm-up step at N/4, then ``--repeats``
steps, each after giving freed heap memory back (``malloc_trim``) and resetting the peak
(VmHWM, Linux): the median step time and the median of the step's peak resident memory above
the resident memory before it. One thread by default. B = 1 throughout.

    python benchmarks/bench_scaling.py [--cases luna,isab] [--repeats 3] [--threads 1] [--n 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

import attnkit as ak
from attnkit.benchmarking.memory import reset_peak as _reset_peak
from attnkit.benchmarking.memory import status as _status
from attnkit.benchmarking.timing import machine

MiB = float(1 << 20)
H, D = 4, 64


@dataclass
class Case:
    """A claim and how to check it: ``build(n)`` returns a step's forward (a tensor to sum and
    differentiate) and the leaves whose gradients are cleared after it."""

    claim: str
    where: str
    n: int
    build: Callable[[int], tuple[Callable[[], Tensor], list[Tensor]]]


def _heads(n: int) -> list[Tensor]:
    return [torch.randn(1, H, n, D, requires_grad=True) for _ in range(3)]


def _part(make: Callable[[int], torch.nn.Module]):
    """A per-head part on q, k, v (1, H, N, d)."""

    def build(n: int):
        part, (q, k, v) = make(n), _heads(n)
        return (lambda: part(q, k, v).context), [q, k, v]

    return build


def _slot(name: str, **extra):
    def make(n: int):
        from attnkit.tasks.parts import build_slot_attention

        if extra:
            return ak.mechanisms.build(name, head_dim=D, num_heads=H, **extra)
        return build_slot_attention(name, head_dim=D, num_heads=H, max_len=n)

    return _part(make)


def _window(n: int):
    from attnkit.efficient.sliding_window import sliding_window_attention

    q, k, v = _heads(n)
    return (lambda: sliding_window_attention(q, k, v, 256)), [q, k, v]


def _layer(make: Callable[[], torch.nn.Module], width: int):
    """A layer on x (1, N, width)."""

    def build(n: int):
        layer = make()
        x = torch.randn(1, n, width, requires_grad=True)
        return (lambda: layer(x)[0]), [x, *layer.parameters()]

    return build


def _cases() -> dict[str, Case]:
    from attnkit.efficient import (
        ISAB,
        BiBloSA,
        LinearAttention,
        LunaAttention,
        NystromAttention,
        PerceiverEncoder,
    )

    return {
        "window": Case(
            "O(N·w·d) time and memory (w = 256)",
            "efficient/sliding_window.py",
            4096,
            _window,
        ),
        "nystrom": Case(
            "O((M + N)·m·d) time, O((M + N)·d + m²) memory (m = 256, fused path)",
            "efficient/nystrom.py, efficient/landmarks.py",
            4096,
            _part(lambda n: NystromAttention(256)),
        ),
        "linear_causal": Case(
            "causal: O(N·m·d) time, O(N·C + N/C·m·d) memory (C = 64)",
            "efficient/kernelized.py, efficient/linear.py",
            4096,
            _part(lambda n: LinearAttention(causal=True)),
        ),
        "rpe_fft": Case(
            "O(N log N · m · d_v)",
            "efficient/rpe_fft.py",
            256,
            _slot("kernel_rpe_fft"),
        ),
        "dsa": Case(
            "O(M·k·d) attention + O(M·N·H^I·d^I) indexer",
            "sparse_trainable/dsa.py",
            256,
            _slot("deepseek_sparse"),
        ),
        "nsa": Case(
            "O(M·(n·l' + w)·d) selected + O(M·N/s·d) compressed",
            "sparse_trainable/nsa.py",
            256,
            _slot("native_sparse"),
        ),
        "retention": Case(
            "chunkwise O(N·C) (C = 64)",
            "linear_family/decay.py",
            4096,
            _slot("retention", form="chunkwise", chunk_size=64),
        ),
        "deltanet": Case(
            "chunkwise O(N·C) (C = 64)",
            "linear_family/deltanet.py",
            2048,
            _slot("deltanet", form="chunkwise", chunk_size=64),
        ),
        "fast_weight": Case(
            "O(N) sequential steps",
            "efficient/fast_weights.py",
            256,
            _slot("fast_weight"),
        ),
        "biblosa": Case(
            "memory O(N·r + (N/r)²) (r = 64)",
            "efficient/biblosa.py",
            1024,
            _layer(lambda: BiBloSA(64, 64), 64),
        ),
        "luna": Case(
            "O(l·N) time and memory (l = 64)",
            "efficient/luna.py",
            4096,
            _layer(lambda: LunaAttention(256, H, 64), 256),
        ),
        "perceiver": Case(
            "linear in N (64 latents)",
            "efficient/perceiver.py",
            4096,
            _layer(lambda: PerceiverEncoder(256, 64, 64, num_heads=H), 64),
        ),
        "isab": Case(
            "O(N·m) (m = 32 inducing points)",
            "efficient/set_transformer.py",
            4096,
            _layer(lambda: ISAB(256, H, 32), 256),
        ),
    }


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _step(forward: Callable[[], Tensor], leaves: list[Tensor]) -> None:
    forward().sum().backward()
    for x in leaves:
        x.grad = None


def cell(name: str, n: int, threads: int, repeats: int) -> dict:
    """One (case, N) in this process: median step seconds and added peak bytes."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    case = _cases()[name]
    _step(*case.build(max(16, n // 4)))  # one-time costs (lazy imports, caches)
    forward, leaves = case.build(n)
    seconds, added = [], []
    for _ in range(repeats):
        _trim()
        ok = _reset_peak()
        base = _status("VmRSS")
        start = time.perf_counter()
        _step(forward, leaves)
        seconds.append(time.perf_counter() - start)
        peak = _status("VmHWM") if ok else None
        if peak is not None and base is not None:
            added.append(peak - base)
    return {
        "seconds": statistics.median(seconds),
        "added": statistics.median(added) if added else None,
    }


def run_cell(name: str, n: int, threads: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--cell", json.dumps([name, n, threads, repeats])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(result: dict, key: str, scale: float, spec: str) -> str:
    value = result.get(key)
    return "failed" if value is None else format(value * scale, spec)


def _ratio(a: dict, b: dict, key: str) -> str:
    x, y = a.get(key), b.get(key)
    return f"{y / x:.1f}" if x and y is not None else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default=None, help="comma-separated case names")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--n", type=int, default=None, help="N of every listed case (default: each case's own)"
    )
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(*json.loads(args.cell))))
        return
    cases = _cases()
    names = args.cases.split(",") if args.cases else list(cases)
    load = os.getloadavg()
    print(f"Machine: {machine()}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(
        f"B=1, float32, forward + backward, {args.threads} thread(s), median of {args.repeats} "
        "steps, fresh process per cell\n"
    )
    print(
        "| case | claim | where | N | ms at N | ms at 4N | time ×  | MiB at N | MiB at 4N "
        "| memory × |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name in names:
        case = cases[name]
        if args.n is not None:
            case.n = args.n
        small = run_cell(name, case.n, args.threads, args.repeats)
        large = run_cell(name, 4 * case.n, args.threads, args.repeats)
        if "error" in small or "error" in large:
            why = small.get("error") or large.get("error")
            print(f"| {name} | {case.claim} | {case.where} | {case.n} | {why} |||||||")
            continue
        print(
            f"| {name} | {case.claim} | {case.where} | {case.n} "
            f"| {_fmt(small, 'seconds', 1e3, '.1f')} | {_fmt(large, 'seconds', 1e3, '.1f')} "
            f"| {_ratio(small, large, 'seconds')} | {_fmt(small, 'added', 1 / MiB, '.1f')} "
            f"| {_fmt(large, 'added', 1 / MiB, '.1f')} | {_ratio(small, large, 'added')} |",
            flush=True,
        )
    print(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
