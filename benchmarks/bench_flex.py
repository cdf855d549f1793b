"""Block-sparse attention against PyTorch's FlexAttention on the CPU, forward, float32.

Patterns (d = 64, H = 4, B = 1): sliding window 256, causal, causal + window 256, document
(4 jagged documents), BigBird (window 128, one global token, 2 random 128-blocks) and causal with
an ALiBi ``score_mod`` (``alibi``; ``alibi-sub``, ``alibi-abs`` and ``alibi-declared`` hand
attnkit the same bias written ``s - m_h * (q - kv)``, ``s - m[h] * (q_idx - kv_idx).abs()`` and
``attnkit.score_mods.alibi(m)``, FlexAttention keeping its documentation's spelling). Each side
gets its own idiomatic inputs: attnkit the mask functions of ``attnkit.patterns`` (its block
mask built from them), FlexAttention a ``mask_mod`` and
``score_mod`` written the way FlexAttention's documentation writes them (comparisons of
``q_idx`` and ``kv_idx``, a lookup into a precomputed table for documents and BigBird's random
blocks), never attnkit's functions. Before any timing both outputs are compared and the
difference printed; a case whose outputs differ by more than 1e-4 fails. Each case runs in a
fresh process with its own (empty) inductor cache, so FlexAttention's set-up time is a cold
``torch.compile``. Times are medians over paired repeats (attnkit and FlexAttention
alternately, after warm-up); the ratio is the median of the per-pair ratios (below 1: attnkit
is faster); the load average before and after each case is recorded. Set-up: attnkit's block
mask build; FlexAttention's ``create_block_mask`` and its first compiled call. attnkit's
forward + backward (FlexAttention has no CPU backward) is reported beside it.

    python benchmarks/bench_flex.py [--sizes 4096,16384] [--threads 1] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

PATTERNS = ["window", "causal", "causal+window", "document", "bigbird", "alibi"]
# The same causal ALiBi handed to attnkit in other spellings (FlexAttention keeps its own).
ALIBI_SPELLINGS = ["alibi-sub", "alibi-abs", "alibi-declared"]
H, D, WINDOW = 4, 64, 256


def _alibi(heads: int):
    """ALiBi as FlexAttention's documentation writes it (one slope per head)."""
    alibi_bias = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])

    def alibi(score, b, h, q_idx, kv_idx):
        bias = alibi_bias[h] * (kv_idx - q_idx)
        return score + bias

    return alibi


def _case(pattern: str, n: int):
    """(mask_mod, score_mod) of one benchmark pattern, as attnkit is given it."""
    from attnkit import patterns

    if pattern == "window":
        return patterns.sliding_window(WINDOW), None
    if pattern == "causal":
        return patterns.causal(), None
    if pattern == "causal+window":
        return patterns.sliding_window(WINDOW, causal=True), None
    if pattern == "document":
        cuts = [0, n * 3 // 10, n * 4 // 10, n * 75 // 100, n]  # 4 documents of unequal length
        return patterns.packed(torch.tensor(cuts)), None
    if pattern == "bigbird":
        return patterns.bigbird(128, n, global_positions=(0,), random_blocks=2, block=128), None
    if pattern == "alibi":
        return patterns.causal(), _alibi(H)
    if pattern in ALIBI_SPELLINGS:
        return patterns.causal(), _alibi_spelled(pattern)
    raise ValueError(f"unknown pattern {pattern!r}; choose from {PATTERNS + ALIBI_SPELLINGS}")


def _alibi_spelled(spelling: str):
    """The ALiBi of :func:`_alibi` written another way: ``s - m_h * (q - kv)``,
    ``s - m[h] * (q_idx - kv_idx).abs()`` (equal under the causal mask), or declared
    (``attnkit.score_mods.alibi``)."""
    import attnkit as ak

    m = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)])
    if spelling == "alibi-declared":
        return ak.score_mods.alibi(m)
    if spelling == "alibi-sub":
        return lambda s, b, h, q, kv: s - m[h] * (q - kv)
    return lambda s, b, h, q_idx, kv_idx: s - m[h] * (q_idx - kv_idx).abs()


def flex_case(pattern: str, n: int, block_table: torch.Tensor | None = None):
    """(mask_mod, score_mod) of one pattern as FlexAttention's documentation writes them.

    ``block_table`` is BigBird's (query block, key block) table of the random blocks (True =
    attend the whole tile), the precomputed layout a BigBird user indexes; it is read from
    attnkit's block mask of the same pattern (its fully allowed tiles: the random blocks and the
    diagonal, which the window covers anyway), so both sides attend the same keys.
    """

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= WINDOW

    def causal_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    if pattern == "window":
        return sliding_window, None
    if pattern == "causal":
        return causal_mask, None
    if pattern == "causal+window":
        return causal_window, None
    if pattern == "document":
        lengths = torch.tensor([0, n * 3 // 10, n * 4 // 10, n * 75 // 100, n]).diff()
        document_id = torch.repeat_interleave(torch.arange(4), lengths)

        def document_masking(b, h, q_idx, kv_idx):
            return document_id[q_idx] == document_id[kv_idx]

        return document_masking, None
    if pattern == "bigbird":
        if block_table is None:
            raise ValueError("bigbird needs block_table, the (query block, key block) table")

        def bigbird(b, h, q_idx, kv_idx):
            local = (q_idx - kv_idx).abs() <= 128
            glob = (q_idx == 0) | (kv_idx == 0)
            return local | glob | block_table[q_idx // 128, kv_idx // 128]

        return bigbird, None
    if pattern == "alibi" or pattern in ALIBI_SPELLINGS:
        return causal_mask, _alibi(H)
    raise ValueError(f"unknown pattern {pattern!r}; choose from {PATTERNS + ALIBI_SPELLINGS}")


def _timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run_case(pattern: str, n: int, threads: int, repeats: int) -> dict:
    """Measure one pattern at one size in this process."""
    torch.set_num_threads(threads)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import attnkit as ak
    from attnkit import patterns

    load_before = os.getloadavg()[0]
    mask_mod, score_mod = _case(pattern, n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))

    bm, ak_build = _timed(lambda: patterns.block_mask(mask_mod, n))
    table = bm.all_allowed if pattern == "bigbird" else None
    flex_mask, flex_score = flex_case(pattern, n, table)
    fbm, flex_build = _timed(lambda: create_block_mask(flex_mask, None, None, n, n, device="cpu"))
    flex = torch.compile(flex_attention)

    def ours():
        return ak.attention(q, k, v, block_mask=bm, score_mod=score_mod).context

    def theirs():
        return flex(q, k, v, block_mask=fbm, score_mod=flex_score)

    first, flex_compile = _timed(theirs)
    err = float((ours() - first).abs().max())
    print(f"{pattern} N={n}: max |attnkit - FlexAttention| = {err:.1e}", file=sys.stderr)
    if not err <= 1e-4:
        raise AssertionError(f"{pattern} N={n}: outputs differ by {err:.1e} (> 1e-4); not timed")
    for _ in range(2):
        ours(), theirs()
    t_ours, t_theirs, ratios = [], [], []
    for i in range(repeats):
        pair = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        times = {}
        for fn in pair:
            times[fn] = _timed(fn)[1]
        t_ours.append(times[ours])
        t_theirs.append(times[theirs])
        ratios.append(times[ours] / times[theirs])

    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    grad = torch.randn(q.shape, generator=g)

    def train():
        out = ak.attention(qg, kg, vg, block_mask=bm, score_mod=score_mod).context
        out.backward(grad)

    train()
    t_train = statistics.median(_timed(train)[1] for _ in range(max(3, repeats // 3)))
    return {
        "pattern": pattern,
        "n": n,
        "density": bm.density,
        "ours_ms": 1e3 * statistics.median(t_ours),
        "flex_ms": 1e3 * statistics.median(t_theirs),
        "ratio": statistics.median(ratios),
        "ours_train_ms": 1e3 * t_train,
        "ak_build_ms": 1e3 * ak_build,
        "flex_build_ms": 1e3 * flex_build,
        "flex_compile_s": flex_compile,
        "max_abs_diff": err,
        "load": f"{load_before:.1f}-{os.getloadavg()[0]:.1f}",
    }


def table(rows: list[dict]) -> str:
    head = (
        "| pattern | N | density | attnkit fwd ms | flex fwd ms | ratio | attnkit fwd+bwd ms "
        "| attnkit block mask ms | flex create_block_mask ms | flex compile s | max abs diff "
        "| load |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['pattern']} | {r['n']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {r['pattern']} | {r['n']} | {r['density']:.3f} | {r['ours_ms']:.1f} "
            f"| {r['flex_ms']:.1f} | **{r['ratio']:.2f}x** | {r['ours_train_ms']:.1f} "
            f"| {r['ak_build_ms']:.0f} | {r['flex_build_ms']:.0f} | {r['flex_compile_s']:.1f} "
            f"| {r['max_abs_diff']:.1e} | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="4096", help="comma-separated N (default 4096)")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9, help="paired repeats per case")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # pattern:N, run in this process
    args = parser.parse_args()
    if args.case:
        pattern, n = args.case.split(":")
        print(json.dumps(run_case(pattern, int(n), args.threads, args.repeats)))
        return

    from attnkit.benchmarking.timing import machine

    torch.set_num_threads(args.threads)
    print(f"Machine: {machine()}; load average before: {os.getloadavg()[0]:.1f}\n")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for pattern in args.patterns.split(","):
            print(f"... {pattern} N={n}", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
                cmd = [sys.executable, __file__, "--case", f"{pattern}:{n}"]
                cmd += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                rows.append({"pattern": pattern, "n": n, "error": last[:120]})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))
    print(f"\nLoad average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
