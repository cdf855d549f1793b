"""MultiHeadAttention against torch.nn.MultiheadAttention, and each score's cost relative to
scaled_dot. Forward + backward, float32."""

from __future__ import annotations

import os

import torch
from torch import nn

import attnkit as ak
from attnkit.benchmarking.timing import median_seconds

__all__ = ["main", "paired_ratios", "score_costs", "versus_torch"]


def _fwd_bwd(module, x, **kw):
    def step():
        out = module(x, x, x, **kw)
        y = out[0] if isinstance(out, tuple) else out
        y.sum().backward()

    return step


def versus_torch(b: int, n: int, e: int, h: int, min_run_time: float) -> str:
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(e, h, batch_first=True)
    ours = ak.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(b, n, e, requires_grad=True)
    # Alternate ours and theirs twice and keep each one's best median, so that drift in the
    # machine's speed during the run does not favour either side.
    t_ours, t_theirs = float("inf"), float("inf")
    for _ in range(2):
        t_ours = min(t_ours, median_seconds(_fwd_bwd(ours, x), min_run_time=min_run_time))
        t_theirs = min(
            t_theirs,
            median_seconds(_fwd_bwd(theirs, x, need_weights=False), min_run_time=min_run_time),
        )
    return "\n".join(
        [
            "### MultiHeadAttention (scaled_dot, softmax) vs torch.nn.MultiheadAttention",
            "",
            f"B={b}, N={n}, E={e}, heads={h}, float32, forward+backward, self-attention; torch "
            "called with need_weights=False (its fastest path).",
            "",
            "| ours (ms) | torch (ms) | ratio ours/torch | target |",
            "|---:|---:|---:|---:|",
            f"| {t_ours * 1e3:.1f} | {t_theirs * 1e3:.1f} | {t_ours / t_theirs:.3f} | <= 1.05 |",
        ]
    )


def score_costs(b: int, n: int, e: int, h: int, min_run_time: float) -> str:
    d = e // h
    x = torch.randn(b, n, e, requires_grad=True)

    def time_score(name: str) -> float:
        torch.manual_seed(0)
        # each score builds itself for H heads of size d over N keys (its class's for_heads)
        score = ak.scores.REGISTRY.get(name).for_heads(d, h, max_len=n)
        mha = ak.MultiHeadAttention(e, h, score=score)
        return median_seconds(_fwd_bwd(mha, x), min_run_time=min_run_time)

    # The baseline is timed first and last; its mean is the reference (drift shows as spread).
    first = time_score("scaled_dot")
    rows = [(name, time_score(name)) for name in ak.scores.available() if name != "scaled_dot"]
    last = time_score("scaled_dot")
    base = (first + last) / 2
    rows.append(("scaled_dot", base))
    lines = [
        "### Score functions relative to scaled_dot",
        "",
        f"MultiHeadAttention, softmax, B={b}, N={n}, E={e}, heads={h} (d={d}; d_w={d} for the "
        "additive family, depth 2 for deep), float32, forward+backward. Scores whose dense "
        "tensor exceeds attnkit.kernels.chunked.DENSE_LIMIT run chunked. scaled_dot timed "
        f"first and last: {first * 1e3:.1f} and {last * 1e3:.1f} ms.",
        "",
        "| score | time (ms) | ratio to scaled_dot |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |"
        for name, t in sorted(rows, key=lambda r: r[1])
    ]
    return "\n".join(lines)


def paired_ratios(
    b: int, n: int, e: int, h: int, names: list[str], repeats: int = 5, base: str = "scaled_dot"
) -> str:
    """Each score's MultiHeadAttention time over ``base``'s, forward + backward, as the median
    of per-round ratios: every round times ``base`` and then each score once, so that a change
    in the machine's load during the run hits both sides of a ratio alike (a loaded machine
    shifts absolute times far more than same-round ratios). The load average is printed beside
    each round's figures. The first call of each score (it may compile tiles) is not timed."""
    import statistics
    import time

    if repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    d = e // h
    x = torch.randn(b, n, e, requires_grad=True)
    steps = {}
    for name in [base, *names]:
        torch.manual_seed(0)
        score = ak.scores.REGISTRY.get(name).for_heads(d, h, max_len=n)
        steps[name] = _fwd_bwd(ak.MultiHeadAttention(e, h, score=score), x)
        steps[name]()  # warm-up: compilation, allocator
    times: dict[str, list[float]] = {name: [] for name in steps}
    loads = []
    for _ in range(repeats):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t)
        loads.append(_load())
    lines = [
        f"### Scores relative to {base}: paired rounds",
        "",
        f"MultiHeadAttention, softmax, B={b}, N={n}, E={e}, heads={h}, float32, forward+backward, "
        f"{torch.get_num_threads()} thread(s), {repeats} rounds; load average after each round: "
        f"{', '.join(loads)}.",
        "",
        f"| score | median time (ms) | median ratio to {base} | ratios per round |",
        "|---|---:|---:|---|",
    ]
    for name in names:
        ratios = [a / r for a, r in zip(times[name], times[base], strict=True)]
        lines.append(
            f"| {name} | {statistics.median(times[name]) * 1e3:.0f} | "
            f"{statistics.median(ratios):.2f} | {', '.join(f'{r:.2f}' for r in ratios)} |"
        )
    lines.append(f"| {base} | {statistics.median(times[base]) * 1e3:.0f} | 1.00 | |")
    return "\n".join(lines)


def main(quick: bool, score_batch: int = 2) -> str:
    if quick:
        return versus_torch(2, 128, 128, 4, 0.5) + "\n\n" + score_costs(1, 64, 64, 4, 0.2)
    return versus_torch(8, 512, 512, 8, 5.0) + "\n\n" + score_costs(score_batch, 512, 512, 8, 2.0)


def _load() -> str:
    """The 1-minute load average, "n/a" where the platform has none."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "n/a"
