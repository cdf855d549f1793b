"""Efficient attention against exact attention as the sequence grows (Soydaner 5.3).

For each N, forward + backward of one attention call on q, k, v of shape (B, H, N, d) (B=1,
H=4, d=64, float32 by default), each configuration in a fresh Python process
(``python -m attnkit.benchmarking.efficient '<json>'``): time = median of repeats after a
warm-up, peak = the process's peak resident memory (``ru_maxrss``), base = that peak before the
first call (interpreter, torch, inputs, parameters). Contestants:

- ``exact SDPA``: ``torch.nn.functional.scaled_dot_product_attention``;
- ``exact chunked``: softmax attention through attnkit's chunked kernel (never forms N × N);
- every registered mechanism that is a per-head attention-slot part, by registry name, built
  by :func:`attnkit.tasks.parts.build_slot_attention` (its head size and N filled, every other
  argument at its default). The default list is those defined in :mod:`attnkit.efficient`,
  so a newly registered one is measured without any change here.

From the measurements: the log-log slope of time and of memory above base against N (least
squares over the measured N), the crossover (the first measured N from which the mechanism is
faster than exact chunked attention at every larger measured N), and at a reference N the
speed-up and memory ratio against exact chunked attention. A contestant whose call takes longer
than ``budget`` seconds is not run at larger N.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.benchmarking.timing import in_subprocess, measure_step

__all__ = [
    "EXACT",
    "Result",
    "candidates",
    "crossover",
    "measure",
    "plot",
    "run_case",
    "slope",
    "table",
]

EXACT = ("exact SDPA", "exact chunked")
GiB = float(1 << 30)
MiB = float(1 << 20)


def candidates() -> list[str]:
    """Registered attention-slot mechanisms of :mod:`attnkit.efficient` (by registry name)."""
    from attnkit.tasks.parts import slot_mechanisms

    return slot_mechanisms("attnkit.efficient")


def run_case(case: dict) -> dict:
    """One configuration in this process: ``{"name", "n", "b", "heads", "d", "repeats"}``."""
    import torch.nn.functional as F

    import attnkit as ak
    from attnkit.tasks.parts import build_slot_attention

    torch.manual_seed(0)
    name, n = case["name"], case["n"]
    b, heads, d = case.get("b", 1), case.get("heads", 4), case.get("d", 64)
    q, k, v = (torch.randn(b, heads, n, d, requires_grad=True) for _ in range(3))
    if name == "exact SDPA":

        def attend():
            return F.scaled_dot_product_attention(q, k, v)

    elif name == "exact chunked":

        def attend():
            return ak.attention(q, k, v, kernel="chunked").context

    else:
        part = build_slot_attention(name, head_dim=d, num_heads=heads, max_len=n)

        def attend():
            return part(q, k, v).context

    def step():
        attend().sum().backward()
        for x in (q, k, v):
            x.grad = None

    return measure_step(step, case.get("repeats", 3))


def _in_subprocess(case: dict, timeout: float) -> dict:
    return in_subprocess(case, timeout, module="attnkit.benchmarking.efficient")


@dataclass
class Result:
    """One contestant's measurements: N -> worker result (seconds, peak_bytes, base_bytes) or
    ``{"error": ...}``."""

    name: str
    cells: dict[int, dict] = field(default_factory=dict)

    def measured(self) -> list[int]:
        return sorted(n for n, c in self.cells.items() if "error" not in c)

    def seconds(self, n: int) -> float | None:
        cell = self.cells.get(n, {})
        return cell.get("seconds")

    def added_bytes(self, n: int) -> float | None:
        cell = self.cells.get(n, {})
        if "error" in cell or not cell:
            return None
        return max(cell["peak_bytes"] - cell["base_bytes"], 1.0)


def measure(
    names: list[str],
    sizes: list[int],
    *,
    repeats: Callable[[int], int] = lambda n: 3 if n <= 4096 else 1,
    budget: float = 120.0,
    timeout: float = 1800.0,
    shape: tuple[int, int, int] = (1, 4, 64),
    progress: Callable[[str], None] = lambda msg: None,
    in_process: bool = False,
) -> list[Result]:
    """Measure each contestant (``EXACT`` names and mechanism names) at each N in a fresh
    process (``in_process``: in this one, for checking the machinery; its peaks are then this
    process's, not each cell's). After a call over ``budget`` seconds a contestant is not run at
    larger N."""
    b, heads, d = shape
    results = []
    for name in names:
        result = Result(name)
        for n in sorted(sizes):
            last = result.measured()
            if last and result.seconds(last[-1]) > budget:
                result.cells[n] = {"error": f"not run: {last[-1]} took over {budget:.0f} s"}
                continue
            progress(f"{name} N={n}")
            case = {"name": name, "n": n, "b": b, "heads": heads, "d": d, "repeats": repeats(n)}
            result.cells[n] = run_case(case) if in_process else _in_subprocess(case, timeout)
        results.append(result)
    return results


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log y against log x; None with fewer than two points."""
    points = [(x, y) for x, y in points if x > 0 and y is not None and y > 0]
    if len(points) < 2:
        return None
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def crossover(result: Result, exact: Result) -> int | None:
    """The first N measured for both from which ``result`` is faster than ``exact`` at every
    larger N measured for both; None when there is none."""
    both = [n for n in result.measured() if n in exact.measured()]
    found = None
    for n in reversed(both):
        if result.seconds(n) < exact.seconds(n):
            found = n
        else:
            break
    return found


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[Result], reference: int, target: float = 1.15) -> str:
    """The markdown tables: time and memory per N, then slopes, crossover and ratios."""
    sizes = sorted({n for r in results for n in r.cells})
    exact = next((r for r in results if r.name == "exact chunked"), None)
    head = "| contestant | " + " | ".join(f"N={n}" for n in sizes) + " |"
    rule = "|---|" + "---:|" * len(sizes)

    def cell(r: Result, n: int, fn: Callable[[int], float | None], spec: str) -> str:
        c = r.cells.get(n)
        if c is None:
            return ""
        if "error" in c:
            return "—" if c["error"].startswith("not run") else "failed"
        return _fmt(fn(n), spec)

    lines = ["Forward + backward time (ms, median)", "", head, rule]
    for r in results:
        lines.append(
            f"| {r.name} | "
            + " | ".join(cell(r, n, lambda m, r=r: r.seconds(m) * 1e3, ".1f") for n in sizes)
            + " |"
        )
    lines += ["", "Peak resident memory above the process's base (MiB)", "", head, rule]
    for r in results:
        lines.append(
            f"| {r.name} | "
            + " | ".join(cell(r, n, lambda m, r=r: r.added_bytes(m) / MiB, ".0f") for n in sizes)
            + " |"
        )
    failures = [
        f"- {r.name} at N={n}: {c['error']}"
        for r in results
        for n, c in sorted(r.cells.items())
        if "error" in c and not c["error"].startswith("not run")
    ]
    if failures:
        lines += ["", "Failed cells:", "", *failures]
    lines += [
        "",
        f"Log-log slopes over the measured N; crossover = first N from which it is faster than "
        f"exact chunked at every larger measured N; ratios against exact chunked at "
        f"N={reference}, or at the largest N both measured (given in brackets) "
        f"(speed-up = chunked time / its time; memory = its added memory / chunked's). "
        f"Target for a linear mechanism: time slope <= {target}, speed-up >= 5 at N=16384.",
        "",
        "| contestant | time slope | memory slope | crossover N | speed-up | memory ratio | "
        f"linear (time slope <= {target}) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        ts = slope([(n, r.seconds(n)) for n in r.measured()])
        ms = slope([(n, r.added_bytes(n)) for n in r.measured()])
        cross, speed, mem, at = "-", None, None, ""
        if exact is not None and r is not exact:
            c = crossover(r, exact)
            cross = "never" if c is None else str(c)
            both = [n for n in r.measured() if n in exact.measured()]
            if both:
                n_ref = reference if reference in both else max(both)
                at = "" if n_ref == reference else f" ({n_ref})"
                speed = exact.seconds(n_ref) / r.seconds(n_ref)
                mem = r.added_bytes(n_ref) / exact.added_bytes(n_ref)
        linear = "-" if ts is None else ("yes" if ts <= target else "no")
        lines.append(
            f"| {r.name} | {_fmt(ts, '.2f')} | {_fmt(ms, '.2f')} | {cross} | "
            f"{_fmt(speed, '.1f')}{at} | {_fmt(mem, '.2f')}{at} | {linear} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> bool:
    """Time against N, log-log, to ``path`` (PNG); False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in results:
        ns = r.measured()
        style = "--" if r.name in EXACT else "-"
        ax.plot(ns, [r.seconds(n) for n in ns], style, marker="o", label=r.name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("forward + backward time (s)")
    ax.set_title("Efficient vs exact attention (B=1, H=4, d=64, float32, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(
    quick: bool,
    names: list[str] | None = None,
    sizes: list[int] | None = None,
    *,
    budget: float = 120.0,
    plot_path: str | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    in_process: bool = False,
) -> str:
    """Run the benchmark and return its markdown; ``quick``: N = 256, 512, 1024, one repeat."""
    if sizes is None:
        sizes = [256, 512, 1024] if quick else [1024 * 2**i for i in range(6)]
    names = list(EXACT) + (candidates() if names is None else names)
    reference = 16384 if 16384 in sizes else max(sizes)
    repeats = (lambda n: 1) if quick else (lambda n: 3 if n <= 4096 else 1)
    results = measure(
        names, sizes, repeats=repeats, budget=budget, progress=progress, in_process=in_process
    )
    text = (
        f"B=1, H=4, d=64, float32, CPU, {torch.get_num_threads()} threads, forward+backward; "
        "fresh process per cell.\n\n" + table(results, reference)
    )
    if plot_path is not None:
        drawn = plot(results, plot_path)
        text += f"\n\nPlot: {plot_path}" if drawn else "\n\n(matplotlib not installed: no plot)"
    return text


if __name__ == "__main__":
    print(json.dumps(run_case(json.loads(sys.argv[1]))))
