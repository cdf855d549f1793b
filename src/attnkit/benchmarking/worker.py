"""One benchmark case in its own process: ``python -m attnkit.benchmarking.worker '<json>'``.

Prints a JSON line: seconds (median of ``repeats`` runs after one warm-up), peak_bytes (the
process's peak resident memory), base_bytes (peak before the first run: interpreter, torch,
inputs).
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.benchmarking.timing import measure_step
from attnkit.kernels import chunked, dense

__all__ = ["build", "run"]


def build(case: dict):
    """Return a zero-argument function doing one forward + backward of the case."""
    torch.manual_seed(0)
    kind, b, n, d = case["kind"], case.get("b", 1), case["n"], case.get("d", 64)
    heads = case.get("heads")
    lead = (b,) if heads is None else (b, heads)
    q, k, v = (torch.randn(*lead, n, d, requires_grad=True) for _ in range(3))

    if kind in ("additive-dense", "additive-chunked"):
        score = ak.scores.Additive(d, d, case.get("d_w", 64))
        align = ak.alignments.Softmax()

        def attend():
            if kind == "additive-dense":
                return dense.attend(q, k, v, score, align).context
            return chunked.attend(q, k, v, score, align, chunk_size=case.get("chunk")).context

    elif kind in ("sparse-package", "sparse-chunked"):
        import entmax

        name = case["align"]
        align = ak.alignments.build(name)
        package = {"sparsemax": entmax.sparsemax, "entmax15": entmax.entmax15}[name]

        def attend():
            if kind == "sparse-package":
                scores = q @ k.transpose(-1, -2) / math.sqrt(d)
                return package(scores, dim=-1) @ v
            return ak.attention(q, k, v, align=align, chunk_size=case.get("chunk", 512)).context

    elif kind in ("sdpa-attnkit", "sdpa-torch"):

        def attend():
            if kind == "sdpa-torch":
                return F.scaled_dot_product_attention(q, k, v)
            return ak.attention(q, k, v).context

    else:
        raise ValueError(f"unknown benchmark kind {kind!r}")

    def step():
        out = attend()
        if case.get("backward", True):
            out.sum().backward()
            for x in (q, k, v):
                x.grad = None

    return step


def run(case: dict) -> dict:
    return measure_step(build(case), case.get("repeats", 3))


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
