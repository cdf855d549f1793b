"""The core benchmarks on one accelerator, sized to finish in a few minutes, as one table.

What ``benchmarks/gpu/run.sh`` runs after the ``cuda``-marked tests. Each case pairs an attnkit
call with the baseline a user would pick instead, on the same device and inputs:

- ``sdpa``: ``ak.attention`` vs ``F.scaled_dot_product_attention``, forward + backward.
- ``flex``: block-sparse attention of a sliding window (``ak.attention(block_mask=...)``) vs
  ``torch.compile(flex_attention)`` with its own ``mask_mod`` (written as FlexAttention's
  documentation writes it), forward + backward (forward only where FlexAttention has no
  backward, on the CPU).
- ``sparsemax``: chunked sparsemax attention vs the dense kernel (the full score matrix),
  forward + backward.
- ``additive``: chunked additive attention vs the dense broadcast formulation, forward +
  backward.
- ``decode``: greedy decoding of a ``DecoderLM`` with its KV cache vs recomputing the whole
  sequence for each new token (time per token).
- ``retention``, ``mamba2``, ``gated_deltanet``: the linear family's chunkwise form vs causal
  SDPA at the same length, forward + backward; their outputs are checked against the part's own
  parallel form (a different function from softmax attention).

Every case checks the two outputs first (max |ours − baseline| / max |baseline|, printed
before any timing; a case whose outputs differ beyond its tolerance fails), then times the two
sides alternately (paired, interleaved repeats after a warm-up, the device synchronised around
each call) and reports the medians and the median of the per-pair ratios (ours / baseline,
below 1: attnkit is faster). Peak memory on CUDA: ``torch.cuda.max_memory_allocated`` above
what was allocated before the step, after ``reset_peak_memory_stats``. The kernel attnkit
selected (``ak.kernels.explain``, with its path) is part of each row.

    python -m attnkit.benchmarking.gpu [--device cuda] [--dry-run] [--out FILE]
        [--cases sdpa,flex] [--timeout 120] [--budget 360] [--tests-summary FILE]

``--dry-run`` runs every case on the CPU at tiny sizes, in this process, to check that the
script's parts work without an accelerator; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "CASES",
    "Pair",
    "Sizes",
    "build",
    "device_header",
    "main",
    "measure",
    "run_case",
    "run_in_subprocess",
    "selection",
    "sizes_for",
    "table",
]

MiB = float(1 << 20)


@dataclass(frozen=True)
class Sizes:
    """The sizes of every case; :func:`sizes_for` picks them for a device."""

    sdpa: tuple[int, int, int, int]  # B, H, N, d
    flex_n: int
    window: int
    sparse_n: int
    additive_n: int
    decode_context: int
    decode_tokens: int
    linear_n: int
    heads: int
    repeats: int
    low_precision: bool  # bfloat16 for the SDPA and FlexAttention cases
    compile: bool = True  # torch.compile FlexAttention (a dry run calls it eagerly)


def sizes_for(device: str, dry_run: bool = False) -> Sizes:
    """Tiny sizes for a dry run, a few seconds per case on an accelerator otherwise."""
    if dry_run:
        return Sizes((1, 2, 64, 16), 256, 32, 64, 32, 16, 2, 128, 2, 1, False, compile=False)
    if device == "cpu":
        return Sizes((1, 4, 1024, 64), 2048, 128, 1024, 512, 256, 8, 2048, 4, 3, False)
    return Sizes((4, 16, 4096, 64), 8192, 256, 4096, 2048, 1024, 32, 8192, 4, 7, True)


@dataclass
class Pair:
    """One case: attnkit's side against a baseline, both zero-argument and returning the
    output; ``backward``: time forward + backward (the sum of the output as the loss)."""

    label: str
    baseline: str
    shape: str
    ours: Callable[[], Tensor]
    theirs: Callable[[], Tensor]
    leaves: list[Tensor]
    backward: bool = True
    check: Callable[[], tuple[Tensor, Tensor]] | None = None  # default: (ours(), theirs())
    tolerance: float = 1e-3
    kernel: str = ""  # the kernel and path attnkit selects, from ak.kernels.explain
    notes: list[str] = field(default_factory=list)


def selection(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str:
    """The kernel (and its path) that ``ak.attention`` selects for this call, and, for the
    chunked kernel, why its fused path was skipped, from ``ak.kernels.explain``."""
    import attnkit as ak

    e = ak.kernels.explain(q, k, v, **kwargs)
    verdict = next(v for v in e.verdicts if v.kernel == e.chosen)
    text = e.chosen if verdict.path is None else f"{e.chosen} ({verdict.path})"
    skipped = [f"{name}: {'; '.join(why)}" for name, why in verdict.skipped_paths]
    return text + (f"; skipped {' / '.join(skipped)}" if skipped else "")


def _qkv(shape, device, dtype, grad: bool = True, seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(grad) for _ in range(3)
    ]


def _sdpa(device: str, s: Sizes) -> Pair:
    import attnkit as ak

    dtype = torch.bfloat16 if s.low_precision else torch.float32
    q, k, v = _qkv(s.sdpa, device, dtype)
    return Pair(
        "ak.attention", "F.scaled_dot_product_attention", f"B,H,N,d = {s.sdpa}, {dtype}",
        lambda: ak.attention(q, k, v).context,
        lambda: F.scaled_dot_product_attention(q, k, v),
        [q, k, v], tolerance=2e-2 if s.low_precision else 1e-4,
        kernel=selection(q, k, v),
    )  # fmt: skip


def _flex(device: str, s: Sizes) -> Pair:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import attnkit as ak
    from attnkit import patterns

    n, w = s.flex_n, s.window
    dtype = torch.bfloat16 if s.low_precision else torch.float32
    backward = device != "cpu"  # FlexAttention has no backward on the CPU
    q, k, v = _qkv((1, s.heads, n, 64), device, dtype, grad=backward)
    bm = ak.kernels.BlockMask.from_mask_mod(patterns.sliding_window(w), n, n, device=device)

    def sliding_window(b, h, q_idx, kv_idx):  # as FlexAttention's documentation writes it
        return (q_idx - kv_idx).abs() <= w

    fbm = create_block_mask(sliding_window, None, None, n, n, device=device)
    flex = torch.compile(flex_attention) if s.compile else flex_attention
    return Pair(
        "ak.attention(block_mask=sliding_window)", "torch.compile(flex_attention)",
        f"B=1, H={s.heads}, N={n}, d=64, window {w}, {dtype}",
        lambda: ak.attention(q, k, v, block_mask=bm).context,
        lambda: flex(q, k, v, block_mask=fbm),
        [q, k, v], backward=backward, tolerance=2e-2 if s.low_precision else 1e-4,
        kernel=selection(q, k, v, block_mask=bm),
        notes=[] if backward else ["forward only (no FlexAttention backward on the CPU)"],
    )  # fmt: skip


def _sparsemax(device: str, s: Sizes) -> Pair:
    import attnkit as ak

    n = s.sparse_n
    q, k, v = _qkv((1, s.heads, n, 64), device, torch.float32)
    return Pair(
        "ak.attention(align='sparsemax'), chunked", "the dense kernel (full score matrix)",
        f"B=1, H={s.heads}, N={n}, d=64, float32",
        lambda: ak.attention(q, k, v, align="sparsemax", kernel="chunked").context,
        lambda: ak.attention(q, k, v, align="sparsemax", kernel="dense").context,
        [q, k, v], tolerance=1e-4,
        kernel=selection(q, k, v, align="sparsemax"),
    )  # fmt: skip


def _additive(device: str, s: Sizes) -> Pair:
    import attnkit as ak
    from attnkit.kernels import chunked, dense

    n = s.additive_n
    q, k, v = _qkv((1, s.heads, n, 64), device, torch.float32)
    score = ak.scores.Additive(64, 64, 64).to(device)
    align = ak.alignments.Softmax()
    return Pair(
        "chunked additive attention", "the dense broadcast formulation",
        f"B=1, H={s.heads}, N={n}, d=d_w=64, float32",
        lambda: chunked.attend(q, k, v, score, align).context,
        lambda: dense.attend(q, k, v, score, align).context,
        [q, k, v, *score.parameters()], tolerance=1e-4,
        kernel=selection(q, k, v, score=score),
    )  # fmt: skip


def _decode(device: str, s: Sizes) -> Pair:
    from attnkit.models.decoder_lm import DecoderLM

    torch.manual_seed(0)
    n, new = s.decode_context, s.decode_tokens
    lm = DecoderLM(256, 256, 4, 4, max_len=n + new + 1).to(device).eval()
    context = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(1))
    context = context.to(device)

    def cached() -> Tensor:
        with torch.no_grad():
            cache = lm.new_cache()
            logits = lm(context, cache=cache)[:, -1:]
            out = [logits]
            for _ in range(new):
                logits = lm(logits.argmax(-1), cache=cache)[:, -1:]
                out.append(logits)
        return torch.cat(out, 1)

    def recomputed() -> Tensor:
        with torch.no_grad():
            ids, out = context, []
            for _ in range(new + 1):
                logits = lm(ids)[:, -1:]
                out.append(logits)
                ids = torch.cat([ids, logits.argmax(-1)], 1)
        return torch.cat(out, 1)

    return Pair(
        f"DecoderLM, KV cache, {new} new tokens", "recomputing the sequence for every token",
        f"4 layers, d_model 256, 4 heads, context {n}, float32",
        cached, recomputed, [], backward=False, tolerance=1e-3,
    )  # fmt: skip


def _linear(name: str) -> Callable[[str, Sizes], Pair]:
    def build_case(device: str, s: Sizes) -> Pair:
        import attnkit as ak

        n = s.linear_n
        torch.manual_seed(0)
        chunkwise = ak.mechanisms.build(
            name, head_dim=64, num_heads=s.heads, form="chunkwise", chunk_size=64
        ).to(device)
        q, k, v = _qkv((1, s.heads, n, 64), device, torch.float32)

        def check() -> tuple[Tensor, Tensor]:
            parallel = ak.mechanisms.build(name, head_dim=64, num_heads=s.heads, form="parallel")
            parallel.load_state_dict(chunkwise.state_dict())
            parallel = parallel.to(device)
            m = min(n, 2048)  # the parallel form holds N × N weights
            with torch.no_grad():
                a, b = (x[..., :m, :] for x in (q, k, v)), (x[..., :m, :] for x in (q, k, v))
                return chunkwise(*a).context, parallel(*b).context

        return Pair(
            f"{name}, chunkwise (chunks of 64)", "causal F.scaled_dot_product_attention",
            f"B=1, H={s.heads}, N={n}, d=64, float32",
            lambda: chunkwise(q, k, v).context,
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            [q, k, v, *chunkwise.parameters()], check=check, tolerance=1e-3,
            notes=["output checked against the part's parallel form, not against SDPA"],
        )  # fmt: skip

    return build_case


CASES: dict[str, Callable[[str, Sizes], Pair]] = {
    "sdpa": _sdpa,
    "flex": _flex,
    "sparsemax": _sparsemax,
    "additive": _additive,
    "decode": _decode,
    "retention": _linear("retention"),
    "mamba2": _linear("mamba2"),
    "gated_deltanet": _linear("gated_deltanet"),
}


def build(name: str, device: str, s: Sizes) -> Pair:
    """The pair of case ``name``; ValueError naming the cases for an unknown one."""
    if name not in CASES:
        raise ValueError(f"case: unknown {name!r}; expected one of {', '.join(CASES)}")
    return CASES[name](device, s)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(pair: Pair, fn: Callable[[], Tensor], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    if pair.backward:
        out.float().sum().backward()
    _sync(device)
    seconds = time.perf_counter() - start
    for x in pair.leaves:
        x.grad = None
    return seconds


def _peak_mib(pair: Pair, fn: Callable[[], Tensor], device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _step(pair, fn, device)
    return (torch.cuda.max_memory_allocated() - before) / MiB


def measure(pair: Pair, device: str, repeats: int, log=print) -> dict:
    """Check the outputs, then time the two sides in paired, interleaved repeats."""
    with torch.no_grad():
        ours, theirs = pair.check() if pair.check is not None else (pair.ours(), pair.theirs())
    ours, theirs = ours.float(), theirs.float()
    if ours.shape != theirs.shape:
        raise AssertionError(f"{pair.label}: output shapes {ours.shape} and {theirs.shape}")
    scale = float(theirs.abs().max()) or 1.0
    diff = float((ours - theirs).abs().max()) / scale
    log(f"{pair.label} vs {pair.baseline}: max rel. diff {diff:.1e}")
    if not diff <= pair.tolerance:
        raise AssertionError(
            f"{pair.label}: outputs differ by {diff:.1e} (> {pair.tolerance:g}); not timed"
        )
    for fn in (pair.ours, pair.theirs):  # warm-up (FlexAttention compiles here)
        _step(pair, fn, device)
    t_ours, t_theirs, ratios = [], [], []
    for r in range(repeats):
        order = (pair.ours, pair.theirs) if r % 2 == 0 else (pair.theirs, pair.ours)
        times = {id(fn): _step(pair, fn, device) for fn in order}
        t_ours.append(times[id(pair.ours)])
        t_theirs.append(times[id(pair.theirs)])
        ratios.append(t_ours[-1] / t_theirs[-1])
    return {
        "label": pair.label,
        "baseline": pair.baseline,
        "shape": pair.shape,
        "pass": "fwd+bwd" if pair.backward else "fwd",
        "diff": diff,
        "ours_ms": 1e3 * statistics.median(t_ours),
        "theirs_ms": 1e3 * statistics.median(t_theirs),
        "ratio": statistics.median(ratios),
        "ours_mib": _peak_mib(pair, pair.ours, device),
        "theirs_mib": _peak_mib(pair, pair.theirs, device),
        "kernel": pair.kernel,
        "notes": "; ".join(pair.notes),
    }


def run_case(name: str, device: str, dry_run: bool = False, log=print) -> dict:
    """Build and measure one case in this process."""
    s = sizes_for(device, dry_run)
    result = measure(build(name, device, s), device, s.repeats, log)
    return {"case": name, **result}


def run_in_subprocess(name: str, device: str, timeout: float, dry_run: bool = False) -> dict:
    """:func:`run_case` in a fresh Python, stopped after ``timeout`` seconds; ``{"case",
    "error"}`` when it failed or ran out of time."""
    cmd = [sys.executable, "-m", "attnkit.benchmarking.gpu", "--case", name, "--device", device]
    cmd += ["--dry-run"] if dry_run else []
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"over the {timeout:g} s limit"}
    sys.stderr.write(done.stderr[-2000:])
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"case": name, "error": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def device_header(device: str) -> list[str]:
    """Lines naming the device, torch and CUDA versions, the host and the date."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        cap = ".".join(map(str, torch.cuda.get_device_capability(torch.device(device))))
        what = f"{name} (compute capability {cap})"
    else:
        what = (
            f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
        )
    return [
        f"- Device: {what}",
        f"- torch {torch.__version__}; CUDA {torch.version.cuda or 'none'}; "
        f"Python {platform.python_version()}",
        f"- Host load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
        f"date {datetime.date.today().isoformat()}",
    ]


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(results: list[dict], device: str, tests: str = "", dry_run: bool = False) -> str:
    """The markdown report of a run."""
    lines = ["# attnkit on one accelerator", ""]
    lines += device_header(device)
    if dry_run:
        lines += ["- Dry run: CPU, tiny sizes, one repeat; the figures mean nothing."]
    if tests:
        lines += [f"- `pytest -m cuda`: {tests}"]
    lines += [
        "",
        "Ratio = attnkit ÷ baseline, the median of paired, interleaved repeats (below 1: "
        "attnkit is faster); memory: peak allocated above the step's start (CUDA only).",
        "",
        "| case | attnkit | baseline | sizes | pass | max rel. diff | attnkit ms | baseline ms "
        "| ratio | attnkit MiB | baseline MiB | kernel selected | notes |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} | | | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['label']} | {r['baseline']} | {r['shape']} | {r['pass']} "
            f"| {r['diff']:.1e} | {r['ours_ms']:.2f} | {r['theirs_ms']:.2f} "
            f"| **{r['ratio']:.2f}** | {_mib(r['ours_mib'])} | {_mib(r['theirs_mib'])} "
            f"| {r['kernel'] or '-'} | {r['notes']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument(
        "--budget", type=float, default=360.0, help="seconds for all cases (later ones skipped)"
    )
    parser.add_argument("--out", help="write the table here (default: print it)")
    parser.add_argument("--tests-summary", help="a file whose last line summarises the tests")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, JSON to stdout
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else args.device
    if args.case:
        result = run_case(args.case, device, args.dry_run, log=lambda m: print(m, file=sys.stderr))
        print(json.dumps(result))
        return 0
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --dry-run on a CPU)")
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected some of {', '.join(CASES)}")
    if device == "cpu":
        torch.set_num_threads(1)
    results = []
    deadline = time.monotonic() + args.budget
    for name in names:
        print(f"... {name}", file=sys.stderr, flush=True)
        left = deadline - time.monotonic()
        if left < 5:
            results.append(
                {"case": name, "error": f"not run: the {args.budget:g} s budget is spent"}
            )
            continue
        if args.dry_run:  # in this process: a check of the parts, not a measurement
            try:
                results.append(
                    run_case(name, device, True, log=lambda m: print(m, file=sys.stderr))
                )
            except Exception as err:
                results.append({"case": name, "error": f"{type(err).__name__}: {err}"[:300]})
        else:
            results.append(run_in_subprocess(name, device, min(args.timeout, left)))
    tests = ""
    if args.tests_summary and os.path.isfile(args.tests_summary):
        with open(args.tests_summary, encoding="utf-8") as f:
            tail = [line.strip() for line in f if line.strip()]
        tests = tail[-1] if tail else "no output"
    text = table(results, device, tests, args.dry_run)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}", file=sys.stderr)
    print(text)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
