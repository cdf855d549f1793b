"""Do the span parts cost what their spans say? Adaptive span (dynamic spans, Sukhbaatar et al.
2019) evaluated in query blocks against the band of keys within ⌈max z + R⌉, and balanced
routing (Roy et al. 2021) evaluated per cluster on gathered blocks, against the dense
formulation of the same attention (every key scored, the rest masked).

Forward time (median, ``torch.utils.benchmark``), float32, B = 1, H = 4, d = 32, in one process:

1. spans: N fixed, the span grows — the band's time grows with it, the dense time does not;
2. length: the span fixed, N grows — the band's time grows as N (per query constant), the
   dense time as N²;
3. routing: N fixed, the clusters grow — balanced routing's time falls as 1/C, against the
   dense masked evaluation.

    python benchmarks/bench_adaptive_span.py [--quick]
"""

from __future__ import annotations

import argparse

import torch

import attnkit as ak
from attnkit.benchmarking.timing import machine, median_seconds
from attnkit.efficient import DynamicSpanAttention, RoutingAttention
from attnkit.efficient.adaptive_span import span_mask

H, D = 4, 32


def _span_part(span: float, max_span: int) -> DynamicSpanAttention:
    part = DynamicSpanAttention(H, D, max_span, ramp=8.0, block=64).eval()
    with torch.no_grad():  # z_t = span for every query: σ(b) = span / S
        part.span_bias.fill_(float(torch.logit(torch.tensor(span / max_span))))
    return part


def _dense_span(part: DynamicSpanAttention, q, k, v):
    """The same attention with every key scored: softmax(e + log m) under the span mask."""
    n = k.shape[-2]
    z = part.spans(q)[..., None]
    distance = (torch.arange(n)[:, None] - torch.arange(n)).abs().float()
    soft = span_mask(distance, z, part.ramp)
    inside = soft > 0
    return ak.attention(q, k, v, mask=inside, bias=torch.where(inside, soft, 1.0).log())


def _time(fn, quick: bool) -> float:
    with torch.no_grad():
        return median_seconds(fn, min_run_time=0.2 if quick else 1.0) * 1e3


def main(quick: bool) -> str:
    torch.manual_seed(0)
    n_fixed = 2048 if quick else 4096
    rows = [
        f"forward, float32, B=1, H={H}, d={D}, {torch.get_num_threads()} threads",
        "",
        "| case | N | span z (R = 8) / clusters C | ours (ms) | dense (ms) | ours / dense |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def span_row(n: int, span: float) -> None:
        q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
        part = _span_part(span, n)
        ours = _time(lambda: part(q, k, v), quick)
        dense = _time(lambda: _dense_span(part, q, k, v), quick)
        rows.append(
            f"| dynamic span | {n} | {span:g} | {ours:.2f} | {dense:.2f} | {ours / dense:.3f} |"
        )

    for span in (16, 64, 256, 1024):
        span_row(n_fixed, span)
    for n in (1024, 2048, 4096) if quick else (1024, 2048, 4096, 8192):
        span_row(n, 64)
    q, k, v = (torch.randn(1, H, n_fixed, D) for _ in range(3))
    for c in (1, 2, 4, 8, 16, 32):
        balanced = RoutingAttention(D, c, balanced=True).eval()
        nearest = RoutingAttention(D, c).eval()  # the same routing idea, dense under a mask
        ours = _time(lambda: balanced(q, k, v), quick)  # noqa: B023
        dense = _time(lambda: nearest(q, k, v), quick)  # noqa: B023
        rows.append(
            f"| balanced routing | {n_fixed} | C = {c} | {ours:.2f} | {dense:.2f} | "
            f"{ours / dense:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller N, shorter timing")
    args = parser.parse_args()
    print(f"Machine: {machine()}\n")
    print(main(args.quick))
