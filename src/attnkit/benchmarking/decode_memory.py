"""Decoding memory and speed of today's attention forms after a long context.

One attention layer (d_model E, H heads, batch 1, float32, eval, no gradients) reads a context
of N tokens and then decodes ``new_tokens`` more, one at a time, for each form:

- ``mha``: :class:`attnkit.MultiHeadAttention` with a :class:`attnkit.kv_cache.LayerCache`
  holding every key and value (2·H·d_h numbers per token);
- ``gqa``: the same with ``num_kv_heads`` shared key/value heads (2·H_kv·d_h);
- ``mla``, ``mla-absorbed``: :class:`attnkit.modern.MultiHeadLatentAttention` with a
  :class:`attnkit.modern.LatentCache` (d_c + d_h^R per token, DeepSeek-V2 Table 1), decoding with
  keys and values expanded from the latents at every step, or with W^UK and W^UV absorbed
  (attention over the latents themselves);
- ``streaming``: multi-head attention with a :class:`attnkit.modern.StreamingCache` (the first
  ``sinks`` tokens and a rolling window of ``window``: constant size once N > sinks + window);
- ``retention``, ``gla``, ``mamba2``, ``deltanet``, ``gated_deltanet``: the parts of
  :mod:`attnkit.linear_family` with a :class:`attnkit.linear_family.RecurrentCache` (one
  d_k × d_v state per head: constant size).

Every cell (form, N) runs in a fresh Python (``python -m attnkit.benchmarking.decode_memory
'<json>'``) so that its peak resident memory is its own. Measured:

- **cache bytes**: counted from the cache's tensors (``nbytes``) after the context, and divided
  by N: bytes held per token of context;
- **peak above base**: the process's peak resident memory (``ru_maxrss``) at the end, less its
  peak before the context was read (interpreter, torch, the layer): the cache plus whatever the
  reading of the context and the decoding steps held at once;
- **decoding peak above base**: the same over the decoding steps alone (Linux: after the
  context, free heap memory is returned with ``malloc_trim`` and the peak is reset through
  ``/proc/self/clear_refs``; then ``VmHWM`` less ``VmRSS`` before the context): the cache plus
  what one step holds at once (a cache that grows by concatenation holds the old and the new
  tensors during each step);
- **tokens/s**: 1 / the median time of one decoding step (``time.perf_counter`` around each of
  the ``new_tokens`` steps, after ``warmup`` steps). A step changes the cache, so the steps are
  timed one by one in sequence rather than repeated on the same state; the median resists the
  stalls of a shared machine.

The context fills the caches of the attention forms chunk by chunk, each chunk through the
layer with a throw-away cache of its own, whose keys and values (for MLA: ``latents`` at their
positions) are then appended: the cache ends up holding exactly what a causal prefill stores
(keys are cached before the position scheme), at a cost linear in N, since the prefill's own
time is not measured. The linear family reads the context through the layer itself (the
chunkwise form, linear in N) into its state. Ratios are against ``mha`` at the same N, in the
same run.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from attnkit.benchmarking.memory import reset_peak as _reset_peak
from attnkit.benchmarking.memory import status as _status

__all__ = ["FORMS", "LINEAR", "Sizes", "main", "run_cell", "sizes", "table"]

LINEAR = ("retention", "gla", "mamba2", "deltanet", "gated_deltanet")
FORMS = ("mha", "gqa", "mla", "mla-absorbed", "streaming", *LINEAR)


@dataclass(frozen=True)
class Sizes:
    """The sizes of one run."""

    d_model: int
    heads: int
    kv_heads: int
    kv_rank: int
    rope_dim: int
    sinks: int
    window: int
    contexts: tuple[int, ...]
    new_tokens: int
    warmup: int
    chunk: int


def sizes(quick: bool) -> Sizes:
    """The quick sizes (seconds, for ``attnkit bench``) or the full ones."""
    if quick:
        return Sizes(64, 4, 2, 32, 8, 2, 60, (128, 512), 8, 2, 64)
    return Sizes(512, 8, 2, 256, 32, 4, 1020, (1024, 4096, 16384, 32768), 64, 4, 512)


def _layer(form: str, s: Sizes) -> torch.nn.Module:
    import attnkit as ak
    from attnkit.modern import MultiHeadLatentAttention

    torch.manual_seed(0)
    if form in ("mla", "mla-absorbed"):
        return MultiHeadLatentAttention(
            s.d_model, s.heads, kv_rank=s.kv_rank, rope_dim=s.rope_dim
        ).eval()
    if form in LINEAR:
        part = ak.mechanisms.build(form, head_dim=s.d_model // s.heads, num_heads=s.heads)
        return ak.MultiHeadAttention(s.d_model, s.heads, attention=part).eval()
    kv = s.kv_heads if form == "gqa" else None
    return ak.MultiHeadAttention(s.d_model, s.heads, num_kv_heads=kv).eval()


def _cache(form: str, s: Sizes):
    from attnkit.kv_cache import LayerCache
    from attnkit.linear_family import RecurrentCache
    from attnkit.modern import LatentCache, StreamingCache

    if form in ("mla", "mla-absorbed"):
        return LatentCache()
    if form == "streaming":
        return StreamingCache(sinks=s.sinks, window=s.window)
    if form in LINEAR:
        return RecurrentCache()
    return LayerCache()


def _chunks(n: int, s: Sizes, seed: int) -> Iterable[torch.Tensor]:
    """The context, (1, ≤ chunk, E) at a time, drawn on the fly (it is never held whole)."""
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, s.chunk):
        yield torch.randn(1, min(s.chunk, n - start), s.d_model, generator=gen)


def fill(form: str, layer: torch.nn.Module, cache, n: int, s: Sizes, seed: int = 0) -> None:
    """Read a context of n tokens into ``cache``: what a causal prefill of the layer stores.

    Attention forms: each chunk goes through the layer with a cache of its own, whose keys and
    values (MLA: the latents and rotary keys at the chunk's positions) are appended to
    ``cache``. Linear family: the chunks go through the layer with ``cache`` (causal)."""
    import attnkit as ak
    from attnkit.kv_cache import LayerCache

    done = 0
    for x in _chunks(n, s, seed):
        m = x.shape[-2]
        if form in ("mla", "mla-absorbed"):
            cache.append(*layer.latents(x, done))
        elif form in LINEAR:
            layer(x, mask=ak.masks.causal(m, done + m), cache=cache)
        else:
            own = LayerCache()
            layer(x, cache=own)
            cache.append(own.k, own.v)
        done += m


def _decoder(form: str, layer: torch.nn.Module, cache) -> Callable[[torch.Tensor], None]:
    """One decoding step: the new token x (1, 1, E) through the layer with the cache."""
    if form == "mla":
        return lambda x: layer(x, cache=cache)
    if form == "mla-absorbed":
        return lambda x: layer(x, cache=cache, absorbed=True)
    return lambda x: layer(x, cache=cache)


def run_cell(case: dict) -> dict:
    """One (form, N) cell in this process: cache bytes after the context, peak resident memory
    above the base, tokens/s of the decoding steps (see the module docstring)."""
    from attnkit.benchmarking.timing import peak_rss

    form, n = case["form"], case["n"]
    s = Sizes(**{k: tuple(v) if k == "contexts" else v for k, v in case["sizes"].items()})
    torch.set_num_threads(case.get("threads", 1))
    with torch.no_grad():
        layer = _layer(form, s)
        cache = _cache(form, s)
        tokens = torch.randn(1, s.warmup + s.new_tokens, s.d_model)
        base = peak_rss()
        rss = _status("VmRSS")
        fill(form, layer, cache, n, s)
        cache_bytes = cache.nbytes
        context_peak = peak_rss()  # before the reset, which also resets ru_maxrss
        reset = rss is not None and _reset_peak()
        step = _decoder(form, layer, cache)
        times = []
        for i in range(s.warmup + s.new_tokens):
            start = time.perf_counter()
            step(tokens[:, i : i + 1])
            if i >= s.warmup:
                times.append(time.perf_counter() - start)
    return {
        "form": form,
        "n": n,
        "cache_bytes": cache_bytes,
        "cached_tokens": len(cache),
        "peak_bytes": max(context_peak, peak_rss()),
        "base_bytes": base,
        "step_seconds": statistics.median(times),
        "decode_peak_bytes": _status("VmHWM") if reset else None,
        "base_rss_bytes": rss if reset else None,
    }


def _ratio(x: float | None, ref: float | None) -> str:
    if x is None or ref is None or ref == 0 or not math.isfinite(x / ref):
        return "—"
    r = x / ref
    return f"{r:.3f}" if r < 0.1 else f"{r:.2f}"


def _decoding_peak(r: dict) -> int | None:
    if r.get("decode_peak_bytes") is None or r.get("base_rss_bytes") is None:
        return None
    return r["decode_peak_bytes"] - r["base_rss_bytes"]


def table(results: Sequence[dict], s: Sizes, threads: int = 1) -> str:
    """The markdown table of the cells' ``results`` (dicts from :func:`run_cell`, or with an
    ``error`` and the ``form`` and ``n``), with ratios against ``mha`` at the same N."""
    by = {(r["form"], r["n"]): r for r in results}
    contexts = sorted({r["n"] for r in results})
    forms = [f for f in FORMS if any((f, n) in by for n in contexts)]
    d_h = s.d_model // s.heads
    lines = [
        "### Decoding memory and speed after a context of N tokens",
        "",
        f"One layer, E = {s.d_model}, H = {s.heads} (d_h = {d_h}), batch 1, float32, "
        f"{threads} thread(s); GQA with {s.kv_heads} key/value heads; MLA with d_c = "
        f"{s.kv_rank}, d_h^R = {s.rope_dim}; streaming with {s.sinks} sinks + a window of "
        f"{s.window}; linear family with one {d_h} × {d_h} state per head. After the context, "
        f"{s.new_tokens} tokens decoded one at a time ({s.warmup} more before them, not timed). "
        "Cache: bytes of the cache's tensors after the context, per token of context; peaks: "
        "the process's peak resident memory above its base before the context, over the "
        "decoding steps alone and over the whole cell, in a fresh process per cell; "
        "tokens/s: 1 / median step time. Ratios: against MHA at the same N.",
        "",
        "| N | form | cache (MiB) | cache bytes / token | vs MHA | decoding peak above base "
        "(MiB) | vs MHA | peak above base, context + decoding (MiB) | vs MHA "
        "| decode (tokens/s) | vs MHA |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in contexts:
        ref = by.get(("mha", n), {})
        ref_cache = ref.get("cache_bytes")
        ref_peak = None if "peak_bytes" not in ref else ref["peak_bytes"] - ref["base_bytes"]
        ref_decoding = _decoding_peak(ref)
        ref_rate = 1 / ref["step_seconds"] if ref.get("step_seconds") else None
        for form in forms:
            r = by.get((form, n))
            if r is None:
                continue
            if "error" in r:
                cells = " | ".join(["—"] * 7)
                lines.append(f"| {n} | {form} | {cells} | — ({r['error']}) | — |")
                continue
            peak = r["peak_bytes"] - r["base_bytes"]
            rate = 1 / r["step_seconds"]
            per_token = r["cache_bytes"] / n
            decoding = _decoding_peak(r)
            shown = "—" if decoding is None else f"{decoding / 2**20:.1f}"
            lines.append(
                f"| {n} | {form} | {r['cache_bytes'] / 2**20:.2f} | {per_token:,.0f} "
                f"| {_ratio(r['cache_bytes'], ref_cache)} | {shown} "
                f"| {_ratio(decoding, ref_decoding)} | {peak / 2**20:.1f} "
                f"| {_ratio(peak, ref_peak)} | {rate:.1f} | {_ratio(rate, ref_rate)} |"
            )
    return "\n".join(lines)


def main(
    quick: bool = False,
    progress: Callable[[str], None] = lambda m: None,
    threads: int = 1,
    forms: Sequence[str] = FORMS,
    contexts: Sequence[int] | None = None,
    timeout: float = 900,
    rounds: int = 1,
) -> str:
    """Run every (form, N) cell in a fresh process and return the table as markdown.

    With ``rounds`` > 1 every cell runs that many times (all cells once, then again), and the
    table shows, for each cell, the round with the fastest decoding steps: the one least
    disturbed by other work on a shared machine."""
    from attnkit.benchmarking.timing import in_subprocess

    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        raise ValueError(f"forms: unknown {unknown}, expected some of {list(FORMS)}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    s = sizes(quick)
    if contexts is not None:
        bad = [n for n in contexts if not isinstance(n, int) or n < 1]
        if bad:
            raise ValueError(f"contexts must be positive integers, got {bad}")
        s = Sizes(**{**asdict(s), "contexts": tuple(contexts)})
    best: dict[tuple[str, int], dict] = {}
    for round_ in range(rounds):
        for n in s.contexts:
            for form in forms:
                case = {"form": form, "n": n, "sizes": asdict(s), "threads": threads}
                out = in_subprocess(case, timeout, module="attnkit.benchmarking.decode_memory")
                progress(f"round {round_ + 1}: {json.dumps({'form': form, 'n': n, **out})}")
                kept = best.get((form, n))
                if (
                    kept is None
                    or "error" in kept
                    or ("error" not in out and out["step_seconds"] < kept["step_seconds"])
                ):
                    best[form, n] = {"form": form, "n": n, **out}
    return table(list(best.values()), s, threads)


if __name__ == "__main__":
    print(json.dumps(run_cell(json.loads(sys.argv[1]))))
