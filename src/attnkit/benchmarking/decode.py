"""Autoregressive decoding with the KV cache against recomputation, and the cache's size with
grouped-query heads.

A decoder-only LM (:class:`attnkit.models.decoder_lm.DecoderLM`; float32, eval, no gradients)
with a context of N tokens already read produces the next tokens two ways:

- **KV cache**: the context is read once (not timed); each new token is one step over one
  position, attending over the cached keys and values: O(N·d) per layer;
- **recomputation**: every new token runs the whole sequence again (what a decoder without a
  cache does): O(N·d²) projections and O(N²·d) attention per layer.

tokens/s = generated tokens / wall time (median of repeats, torch.utils.benchmark), both ways
in the same process with the same number of threads (``threads``; 1 by default: on a shared
2-core machine a second thread mostly waits for a core, which makes every small step of the
cached decoder slower and noisier). The cache's
bytes are counted exactly from its tensors (``KVCache.nbytes``) for standard multi-head attention
(H key/value heads), grouped-query (H/4) and multi-query attention (one head).

An encoder–decoder (:class:`attnkit.Transformer`) decoding step by step over an encoder output
of N positions reads the same memory at every step: with the memory cache
(``LayerCache.memory``) each layer's cross-attention projects it once per decode; without it
(the memory caches emptied before every step, what a decoder that caches only its own keys and
values does) every step projects all N positions again: O(N·d²) per step and layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnkit.benchmarking.timing import median_seconds
from attnkit.encoder_decoder import Transformer
from attnkit.kv_cache import KVCache, MemoryCache
from attnkit.models.decoder_lm import DecoderLM

__all__ = ["Sizes", "main", "sizes"]


@dataclass(frozen=True)
class Sizes:
    d_model: int
    heads: int
    layers: int
    vocab: int
    contexts: tuple[int, ...]
    new_tokens: int
    min_run_time: float


def sizes(quick: bool) -> Sizes:
    if quick:
        return Sizes(32, 8, 2, 64, (64, 128), 4, 0.05)
    return Sizes(256, 8, 4, 256, (1024, 4096), 32, 2.0)


def _model(s: Sizes, kv_heads: int) -> DecoderLM:
    torch.manual_seed(0)
    lm = DecoderLM(
        s.vocab,
        s.d_model,
        s.heads,
        s.layers,
        max_len=max(s.contexts) + s.new_tokens + 1,
        num_kv_heads=kv_heads,
    )
    return lm.eval()


def _copy(cache: KVCache) -> KVCache:
    """A cache holding the same tensors (appending makes new ones, so the original stays)."""
    out = KVCache(len(cache))
    for mine, theirs in zip(out.layers, cache.layers, strict=True):
        mine.k, mine.v = theirs.k, theirs.v
    return out


def _rates(lm: DecoderLM, n: int, s: Sizes, recompute: bool) -> tuple[float, float | None, int]:
    """(cached tokens/s, recomputation tokens/s or None, cache bytes at context n)."""
    context = torch.randint(0, s.vocab, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        filled = lm.new_cache()
        lm(context, cache=filled)

        def cached() -> None:
            cache = _copy(filled)
            token = context[:, -1:]
            for _ in range(s.new_tokens):
                token = lm(token, cache=cache)[:, -1:].argmax(-1)

        def recomputed() -> None:  # one new token: the whole sequence again
            lm(context)[:, -1].argmax(-1)

        per_token = median_seconds(cached, min_run_time=s.min_run_time) / s.new_tokens
        full = median_seconds(recomputed, min_run_time=s.min_run_time) if recompute else None
    return 1 / per_token, None if full is None else 1 / full, filled.nbytes


def _cross_rates(s: Sizes, n: int) -> tuple[float, float]:
    """(tokens/s with the memory cache, tokens/s projecting the memory at every step)."""
    torch.manual_seed(0)
    model = Transformer(
        s.d_model, s.heads, encoder_layers=1, decoder_layers=s.layers, d_ff=2 * s.d_model
    ).eval()
    memory = torch.randn(1, n, s.d_model)
    steps = torch.randn(1, s.new_tokens, s.d_model)

    def run(keep_memory: bool) -> None:
        cache = model.decoder.new_cache()
        for i in range(s.new_tokens):
            if not keep_memory:
                for layer in cache.layers:
                    layer.memory = MemoryCache()
            model.decode(steps[:, i : i + 1], memory, cache=cache)

    with torch.no_grad():
        kept = median_seconds(lambda: run(True), min_run_time=s.min_run_time)
        again = median_seconds(lambda: run(False), min_run_time=s.min_run_time)
    return s.new_tokens / kept, s.new_tokens / again


def main(
    quick: bool = False, progress: Callable[[str], None] = lambda m: None, threads: int = 1
) -> str:
    """The two tables as markdown, measured with ``threads`` threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _tables(sizes(quick), progress)
    finally:
        torch.set_num_threads(before)


def _tables(s: Sizes, progress: Callable[[str], None]) -> str:
    desc = (
        f"DecoderLM embed_dim={s.d_model}, num_heads={s.heads}, layers={s.layers}, "
        f"vocab={s.vocab}, batch 1, float32, greedy, {torch.get_num_threads()} threads"
    )
    lines = [
        "### Decoding: KV cache vs recomputation",
        "",
        f"{desc}; cached: {s.new_tokens} new tokens after a context of N; recomputation: one "
        "token per full pass over N.",
        "",
        "| context N | cached (tokens/s) | recomputation (tokens/s) | speed-up | target |",
        "|---:|---:|---:|---:|---:|",
    ]
    mha = _model(s, s.heads)
    for n in s.contexts:
        progress(f"decode N={n}")
        fast, slow, _ = _rates(mha, n, s, recompute=True)
        slow = float("nan") if slow is None else slow
        target = ">= 10" if n == max(s.contexts) else ""
        lines.append(f"| {n} | {fast:.1f} | {slow:.2f} | {fast / slow:.1f} | {target} |")
    n = max(s.contexts)
    lines += [
        "",
        f"### KV cache size: grouped-query vs standard multi-head attention (N={n})",
        "",
        f"{desc}; bytes of all layers' cached keys and values after N tokens.",
        "",
        "| key/value heads | cache (MiB) | ratio to standard MHA | cached (tokens/s) |",
        "|---|---:|---:|---:|",
    ]
    base = None
    for kv in (s.heads, max(1, s.heads // 4), 1):
        progress(f"cache size kv_heads={kv}")
        rate, _, nbytes = _rates(_model(s, kv), n, s, recompute=False)
        base = nbytes if base is None else base
        name = {s.heads: "standard MHA", 1: "multi-query"}.get(kv, "grouped-query")
        lines.append(f"| {kv} ({name}) | {nbytes / 2**20:.2f} | {nbytes / base:.3f} | {rate:.1f} |")
    lines += [
        "",
        "### Encoder–decoder: cross-attention memory cache",
        "",
        f"attnkit.Transformer embed_dim={s.d_model}, num_heads={s.heads}, "
        f"decoder layers={s.layers}, "
        f"batch 1, float32, {torch.get_num_threads()} threads; {s.new_tokens} decoding steps "
        "with the self-attention KV cache over an encoder output of N positions.",
        "",
        "| memory N | memory cached (tokens/s) | memory projected every step (tokens/s) "
        "| speed-up |",
        "|---:|---:|---:|---:|",
    ]
    for n in s.contexts:
        progress(f"cross-attention memory N={n}")
        kept, again = _cross_rates(s, n)
        lines.append(f"| {n} | {kept:.1f} | {again:.1f} | {kept / again:.1f} |")
    return "\n".join(lines)
