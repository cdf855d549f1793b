"""Serving caches: paged attention read in place against today's gathered view and the
contiguous cache (time and memory per decoding step), and the 8-bit KV cache's bytes per token
and error against the float cache.

    python benchmarks/serving_caches.py [--contexts 4096 8192 16384 32768] [--steps 5]
        [--quick]

Paged step: one MultiHeadAttention layer (H = 8 heads of d = 64, H_kv = 2, RoPE, float32), one
sequence of N cached tokens, one new token; the step is timed (median of ``--steps``) and
rolled back after each run, so every run sees N. "allocated" is the bytes of the new tensors the
operations of one step make (what it writes besides the cache), "peak live" the most of those
alive at once (tensors counted until their last view dies), both recorded by a dispatch mode.

Quantised cache: bytes per token and layer of LayerCache (float32) and QuantizedLayerCache
(group 32), the max error of one layer's outputs after N tokens, and a random DecoderLM's
logits and greedy tokens decoded through both caches.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit as ak
from attnkit import masks
from attnkit.benchmarking.timing import machine
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.kv_quant import QuantizedKVCache, QuantizedLayerCache
from attnkit.models import speculative
from attnkit.models.decoder_lm import DecoderLM
from attnkit.paged_cache import PagedKVCache

E, H, KV, D = 512, 8, 2, 64


class Allocations(TorchDispatchMode):
    """Bytes of the new tensors the operations make: in all, and the most alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.live = self.peak = 0
        self._holders: dict[int, list[int]] = {}  # storage -> [live tensors, bytes]

    def _drop(self, ptr: int) -> None:
        entry = self._holders[ptr]
        entry[0] -= 1
        if not entry[0]:
            self.live -= entry[1]
            del self._holders[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)} - set(
            self._holders
        )
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in given:  # an in-place write or a view of an input made outside
                continue
            if ptr not in self._holders:
                size = t.untyped_storage().nbytes()
                self._holders[ptr] = [0, size]
                self.total += size
                self.live += size
                self.peak = max(self.peak, self.live)
            self._holders[ptr][0] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


def _layer() -> ak.MultiHeadAttention:
    torch.manual_seed(0)
    return ak.MultiHeadAttention(E, H, num_kv_heads=KV, position="rope").eval()


def _filled(kind: str, n: int, k: torch.Tensor, v: torch.Tensor):
    """A cache of one sequence holding the keys (1, KV, n, D) and values."""
    if kind == "contiguous":
        cache = LayerCache()
        cache.k, cache.v = k.clone(), v.clone()
        return cache, None
    paged = PagedKVCache(1, page_size=16, gather=kind == "paged, gathered view")
    seq = paged.add()
    with paged.step([seq], [n]):
        paged[0]._write(k, v, paged._step)
        paged._step._appended.add(0)
    return paged, seq


def paged_rows(contexts: list[int], steps: int) -> list[str]:
    mha = _layer()
    rows = []
    for n in contexts:
        g = torch.Generator().manual_seed(n)
        k, v = (torch.randn(1, KV, n, D, generator=g) for _ in range(2))
        x = torch.randn(1, 1, E, generator=g)
        outs = {}
        for kind in ("contiguous", "paged, gathered view", "paged, in place"):
            cache, seq = _filled(kind, n, k, v)

            def step(cache=cache, seq=seq, x=x):
                if seq is None:
                    out = mha(x, cache=cache).context
                    cache.rollback(1)
                    return out
                with cache.step([seq], [1]) as s:
                    out = mha(x, cache=cache[0], mask=s.mask).context
                cache.rollback(1)
                return out

            with torch.no_grad():
                outs[kind] = step()
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                with Allocations() as spy:
                    step()
            ms = statistics.median(times) * 1e3
            diff = (outs[kind] - outs["contiguous"]).abs().max().item()
            rows.append(
                f"| {n} | {kind} | {ms:.2f} | {spy.total / 2**20:.2f} | "
                f"{spy.peak / 2**20:.2f} | {diff:.1e} | {os.getloadavg()[0]:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def quant_rows(n: int) -> list[str]:
    mha = _layer()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, E, generator=g)
    rows = []
    with torch.no_grad():
        caches = {"float32 LayerCache": LayerCache(), "int8 QuantizedLayerCache": None}
        caches["int8 QuantizedLayerCache"] = QuantizedLayerCache(group=32)
        outs = {}
        for name, cache in caches.items():
            outs[name] = mha(x, cache=cache, mask=masks.causal(n)).context
            step = torch.randn(1, 1, E, generator=torch.Generator().manual_seed(2))
            outs[name] = torch.cat([outs[name], mha(step, cache=cache).context], 1)
        for name, cache in caches.items():
            err = (outs[name] - outs["float32 LayerCache"]).abs().max().item()
            scale = outs["float32 LayerCache"].abs().max().item()
            rows.append(
                f"| {name} | {cache.nbytes / (n + 1):.0f} | {err:.1e} (outputs up to {scale:.2f}) |"
            )
            print(rows[-1], flush=True)
    return rows


def lm_rows(prompt_len: int, new: int) -> list[str]:
    torch.manual_seed(0)
    lm = DecoderLM(1000, E, H, 4, max_len=prompt_len + new, num_kv_heads=KV, position="rope")
    lm.eval()
    prompt = torch.randint(0, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    runs = {}
    with torch.no_grad():
        for name, cache in (("float32", KVCache(4)), ("int8", QuantizedKVCache(4, group=32))):
            tokens, logits, feed = [], [], prompt
            for _ in range(new):
                last = lm(feed, cache=cache)[:, -1]
                logits.append(last)
                feed = last.argmax(-1, keepdim=True)
                tokens.append(int(feed))
            runs[name] = (tokens, torch.stack(logits), cache.nbytes)
    (ft, fl, fb), (qt, ql, qb) = runs["float32"], runs["int8"]
    agree = sum(a == b for a, b in zip(ft, qt, strict=True))
    first = next((i for i, (a, b) in enumerate(zip(ft, qt, strict=True)) if a != b), None)
    return [
        f"| {prompt_len} + {new} | {(ql - fl).abs().max().item():.1e} | "
        f"{fl.abs().max().item():.2f} | {agree}/{new} | "
        f"{'none' if first is None else first} | {qb / fb:.3f} |"
    ]


def speculative_rows(n: int = 32) -> list[str]:
    """Acceptance and calls of speculative decoding on tiny random float64 models (V = 17):
    the target, drafts equal to it, perturbed copies of it and a small unrelated model."""

    def lm(seed, embed_dim=16, layers=2, **kw):
        torch.manual_seed(seed)
        kw.setdefault("position", "rope")
        return DecoderLM(17, embed_dim, 2, layers, max_len=64, dtype=torch.float64, **kw).eval()

    def near(scale):
        draft = copy.deepcopy(target)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * p.std() * scale)
        return draft

    target = lm(0)
    prompt = torch.randint(0, 17, (1, 5), generator=torch.Generator().manual_seed(1))
    want = target.generate(prompt, n)
    drafts = {
        "identical to the target": target,
        "target + 0.1 noise": near(0.1),
        "target + 0.3 noise": near(0.3),
        "small random (E = 8, 1 layer)": lm(1, 8, 1, position=None),
    }
    rows = []
    for name, draft in drafts.items():
        for k in (2, 4):
            out, st = speculative.generate(target, draft, prompt, n, k=k, return_stats=True)
            rows.append(
                f"| {name} | {k} | {torch.equal(out, want)} | {st.target_calls} | "
                f"{st.draft_calls} | {st.accepted}/{st.proposed} = {st.acceptance_rate:.2f} |"
            )
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="contexts 1024 and 2048, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.steps = [1024, 2048], 3
    torch.set_num_threads(args.threads)
    print(f"Machine: {machine()}; threads: {args.threads}")
    print(f"Date: {datetime.date.today()}; load average at start: {os.getloadavg()}\n")
    print("| N | cache | ms / step | allocated MiB | peak live MiB | max diff | load |")
    print("|---|---|---|---|---|---|---|")
    paged_rows(args.contexts, args.steps)
    n = min(args.contexts)
    print(f"\n| cache (N = {n}, one layer) | bytes / token | max abs error of outputs |")
    print("|---|---|---|")
    quant_rows(n)
    print(
        "\n| tokens | max abs logit error | max abs logit | greedy agree | first differ "
        "| int8 / float32 bytes |"
    )
    print("|---|---|---|---|---|---|")
    for row in lm_rows(256, 64 if not args.quick else 16):
        print(row)
    print("\n| draft (n = 32 tokens) | k | equals greedy | target calls | draft calls | accepted |")
    print("|---|---|---|---|---|---|")
    speculative_rows()
    print(f"\nLoad average at the end: {os.getloadavg()}")
