"""Chunked (memory-efficient) kernels against the baselines users would pick instead:
the dense broadcast formulation of additive attention, the entmax package on dense scores,
and torch's scaled_dot_product_attention; and the machine's matmul rate as the limit."""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.benchmarking.timing import in_subprocess
from attnkit.kernels import chunked, dense

__all__ = [
    "additive_paired",
    "additive_table",
    "limits_table",
    "main",
    "sdpa_table",
    "sparse_table",
    "tanh_table",
]

GiB = 1 << 30


def _gib(result: dict) -> str:
    return "-" if "error" in result else f"{result['peak_bytes'] / GiB:.2f}"


def _ms(result: dict) -> str:
    return "-" if "error" in result else f"{result['seconds'] * 1e3:.0f}"


def _ratio(a: dict, b: dict, key: str) -> str:
    """a[key] / b[key]; "-" when either cell failed, "n/a" when b[key] is not positive."""
    if "error" in a or "error" in b:
        return "-"
    if not b[key] > 0:
        return "n/a"
    return f"{a[key] / b[key]:.3f}"


def _above_base(a: dict, b: dict) -> str:
    """Ratio of the peaks above each process's base (what the computation itself added).

    The peak is the process's resident high-water mark, so a computation that fits in memory the
    process already held adds nothing: when the baseline added nothing there is no ratio.
    """
    if "error" in a or "error" in b:
        return "-"
    ours, theirs = (max(r["peak_bytes"] - r["base_bytes"], 0) for r in (a, b))
    if theirs == 0:
        return "n/a (baseline added no memory)"
    return f"{ours / theirs:.3f}"


def additive_table(sizes: list[int], dense_max: int, progress) -> str:
    lines = [
        "### Additive attention: chunked vs the dense broadcast formulation",
        "",
        "B=1, M=N, d=64, d_w=64, softmax, float32, forward+backward. Peak = the process's peak "
        "resident memory (fresh process per cell; the interpreter, torch and the inputs take "
        "the 'base' part; 'above base' compares what each computation added).",
        "",
        "| N | dense (ms) | chunked (ms) | time chunked/dense | dense peak (GiB) | "
        "chunked peak (GiB) | base (GiB) | peak chunked/dense | above base |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sizes:
        repeats = 3 if n <= 4096 else 1
        progress(f"additive N={n}: chunked")
        ours = in_subprocess({"kind": "additive-chunked", "n": n, "repeats": repeats})
        if n <= dense_max:
            progress(f"additive N={n}: dense")
            base = in_subprocess({"kind": "additive-dense", "n": n, "repeats": repeats})
        else:
            need = 4 * n * n * 64 * 3 / GiB  # pre-activation, tanh output, and a gradient
            base = {"error": f"not run: needs about {need:.0f} GiB"}
        lines.append(
            f"| {n} | {_ms(base)} | {_ms(ours)} | {_ratio(ours, base, 'seconds')} | "
            f"{_gib(base) if 'error' not in base else base['error']} | {_gib(ours)} | "
            f"{ours.get('base_bytes', 0) / GiB:.2f} | {_ratio(ours, base, 'peak_bytes')} | "
            f"{_above_base(ours, base)} |"
        )
    return "\n".join(lines)


def sparse_table(n: int, progress) -> str:
    lines = [
        "### Sparsemax and 1.5-entmax: chunked vs the entmax package on dense scores",
        "",
        f"B=1, M=N={n}, d=64, scaled_dot scores, float32, forward+backward; baseline: "
        "entmax.sparsemax / entmax.entmax15 on the full score matrix, then weights @ v.",
        "",
        "| alignment | package (ms) | chunked (ms) | time ratio | package peak (GiB) | "
        "chunked peak (GiB) | peak ratio | above base |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("sparsemax", "entmax15"):
        progress(f"{name} N={n}")
        theirs = in_subprocess({"kind": "sparse-package", "n": n, "align": name})
        ours = in_subprocess({"kind": "sparse-chunked", "n": n, "align": name})
        lines.append(
            f"| {name} | {_ms(theirs)} | {_ms(ours)} | {_ratio(ours, theirs, 'seconds')} | "
            f"{_gib(theirs)} | {_gib(ours)} | {_ratio(ours, theirs, 'peak_bytes')} | "
            f"{_above_base(ours, theirs)} |"
        )
    return "\n".join(lines)


def sdpa_table(b: int, heads: int, n: int, progress) -> str:
    progress("scaled_dot + softmax vs SDPA")
    case = {"b": b, "heads": heads, "n": n, "repeats": 10}
    ours = in_subprocess({"kind": "sdpa-attnkit", **case})
    theirs = in_subprocess({"kind": "sdpa-torch", **case})
    return "\n".join(
        [
            "### scaled_dot + softmax through attnkit.attention vs F.scaled_dot_product_attention",
            "",
            f"B={b}, heads={heads}, M=N={n}, d=64, float32, forward+backward.",
            "",
            "| attnkit (ms) | SDPA (ms) | ratio | target |",
            "|---:|---:|---:|---:|",
            f"| {_ms(ours)} | {_ms(theirs)} | {_ratio(ours, theirs, 'seconds')} | <= 1.05 |",
        ]
    )


def _best(fn, repeats: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def limits_table(n: int, progress) -> str:
    """Achieved forward rates as a fraction of the machine's float32 matmul rate."""
    progress("matmul rate and achieved rates")
    torch.manual_seed(0)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = 2 * 2048**3 / _best(lambda: a @ b)
    d, d_w = 64, 64
    q, k, v = (torch.randn(1, n, d) for _ in range(3))
    score, soft = ak.scores.Additive(d, d, d_w), ak.alignments.Softmax()
    rows = []
    with torch.no_grad():
        t = _best(lambda: F.scaled_dot_product_attention(q, k, v))
        rows.append(("SDPA (torch)", 4 * n * n * d / t, "4·M·N·d"))
        t = _best(lambda: ak.attention(q, k, v, score="dot", align="sparsemax", chunk_size=512))
        rows.append(("sparsemax chunked (attnkit)", 4 * n * n * d / t, "4·M·N·d"))
        add_flops = 2 * n * n * (d_w + d)
        t = _best(lambda: chunked.attend(q, k, v, score, soft))
        rows.append(("additive chunked (attnkit)", add_flops / t, "2·M·N·(d_w + d), tanh free"))
        if n <= 2048:
            t = _best(lambda: dense.attend(q, k, v, score, soft))
            rows.append(("additive dense broadcast", add_flops / t, "2·M·N·(d_w + d), tanh free"))
    lines = [
        "### The limit: achieved forward rate / float32 matmul rate",
        "",
        f"Matmul 2048×2048×2048: {peak / 1e9:.1f} GFLOP/s. Forward only, B=1, M=N={n}, d=64.",
        "",
        "| kernel | GFLOP/s | fraction of matmul | flops counted |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {name} | {r / 1e9:.1f} | {r / peak:.2f} | {what} |" for name, r, what in rows]
    return "\n".join(lines)


def tanh_table(n: int, progress, compile_tile: bool = True) -> str:
    """Additive attention's limit: tanh evaluations per second, achieved vs the machine's.

    The machine's rate is ``torch.tanh`` over 2**24 float32 elements into a preallocated output
    (one pass through memory, vectorised); additive attention needs M·N·d_w of them per forward.
    """
    from attnkit.kernels import compiled

    progress("tanh rate and additive attention's rate")
    torch.manual_seed(0)
    x = torch.randn(1 << 24)
    out = torch.empty_like(x)
    limit = x.numel() / _best(lambda: torch.tanh(x, out=out))
    rational = None
    if compile_tile:
        from attnkit.kernels import fast_tanh

        fast = compiled.compile_tile(fast_tanh.tanh)
        rational = x.numel() / _best(lambda: fast(x))
    d, d_w = 64, 64
    q, k, v = (torch.randn(1, n, d) for _ in range(3))
    score, soft = ak.scores.Additive(d, d, d_w), ak.alignments.Softmax()
    evals = n * n * d_w
    rows = []
    with torch.no_grad():
        before = compiled.enabled()
        try:
            compiled.set_enabled(False)
            rows.append(
                (
                    "additive chunked, eager tile",
                    evals / _best(lambda: chunked.attend(q, k, v, score, soft)),
                )
            )
            if compile_tile:
                compiled.set_enabled(True)
                chunked.attend(q, k, v, score, soft)  # compile outside the timing
                rows.append(
                    (
                        "additive chunked, compiled tile",
                        evals / _best(lambda: chunked.attend(q, k, v, score, soft)),
                    )
                )
        finally:
            compiled.set_enabled(before)
        if n <= 2048:
            rows.append(
                (
                    "additive dense broadcast",
                    evals / _best(lambda: dense.attend(q, k, v, score, soft)),
                )
            )
    lines = [
        "### The limit of additive attention: tanh evaluations per second",
        "",
        f"torch.tanh over 2^24 float32 elements: {limit / 1e9:.2f} G tanh/s (the machine's rate). "
        f"Forward only, B=1, M=N={n}, d=d_w=64: M·N·d_w tanh evaluations per call.",
        "",
        "| kernel | G tanh/s | fraction of torch.tanh's rate |",
        "|---|---:|---:|",
    ]
    if rational is not None:
        rows.insert(
            0, ("rational tanh (attnkit.kernels.fast_tanh), compiled, 2^24 elements", rational)
        )
    # three significant digits: a small quick run can be well under 0.01 G tanh/s
    lines += [f"| {name} | {r / 1e9:.3g} | {r / limit:.3g} |" for name, r in rows]
    return "\n".join(lines)


def additive_paired(n: int, repeats: int = 3, d_w: int = 64) -> str:
    """Chunked (compiled tiles) against dense additive attention, B=1, M=N=``n``, d=64,
    forward + backward, timed in alternation in one process (dense, chunked, dense, ...): the
    median of per-round ratios, with the load average after each round. Memory is not
    compared here (see :func:`additive_table`, a fresh process per cell)."""
    import statistics

    from attnkit.kernels import compiled

    if repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, n, 64, requires_grad=True) for _ in range(3))
    score, soft = ak.scores.Additive(64, 64, d_w), ak.alignments.Softmax()

    def step(kernel):
        def run():
            kernel.attend(q, k, v, score, soft).context.sum().backward()

        return run

    before = compiled.enabled()
    compiled.set_enabled(True)
    try:
        ours, theirs = step(chunked), step(dense)
        ours()  # compiles the tile
        times: dict[str, list[float]] = {"dense": [], "chunked": []}
        loads = []
        for _ in range(repeats):
            for name, fn in (("dense", theirs), ("chunked", ours)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
            loads.append(_load())
    finally:
        compiled.set_enabled(before)
    ratios = [c / d for c, d in zip(times["chunked"], times["dense"], strict=True)]
    return "\n".join(
        [
            f"### Additive attention, chunked/dense in alternation (N={n})",
            "",
            f"B=1, M=N={n}, d=64, d_w={d_w}, softmax, float32, forward+backward, "
            f"{torch.get_num_threads()} thread(s); load average after each round: "
            f"{', '.join(loads)}.",
            "",
            "| dense (ms, median) | chunked (ms, median) | median ratio | ratios per round |",
            "|---:|---:|---:|---|",
            f"| {statistics.median(times['dense']) * 1e3:.0f} | "
            f"{statistics.median(times['chunked']) * 1e3:.0f} | {statistics.median(ratios):.3f} | "
            f"{', '.join(f'{r:.3f}' for r in ratios)} |",
        ]
    )


def main(quick: bool, progress=lambda msg: None) -> str:
    if quick:
        parts = [
            additive_table([256, 1024], 1024, progress),
            sparse_table(1024, progress),
            sdpa_table(2, 4, 256, progress),
            limits_table(1024, progress),
            tanh_table(512, progress),
        ]
    else:
        parts = [
            additive_table([1024, 4096, 16384], 4096, progress),
            sparse_table(4096, progress),
            sdpa_table(4, 8, 1024, progress),
            limits_table(2048, progress),
            tanh_table(2048, progress),
        ]
    return "\n\n".join(parts)


def _load() -> str:
    """The 1-minute load average, "n/a" where the platform has none."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "n/a"
