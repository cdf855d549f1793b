"""Efficient mechanisms against their reference packages: forward + backward time and peak
memory at matched hyper-parameters and weights, and a check that both give the same output.

Pairs (B=1, H=4, d=64, float32, CPU, one thread by default):

Each peer runs with its package's defaults, except the sizes that define the compared
configuration (heads, hash rounds) and the flags named below that make it compute the same
function as ours.

- Performer vs ``performer-pytorch`` ``FastAttention(dim_heads=64)`` (its default
  nb_features = int(d·ln d) = 266 orthogonal features): ours with as many features, set to the
  peer's projection matrix. The peer adds eps = 1e-4 to every feature; the output check
  runs the peer's feature map with eps = 0 (timing uses the peer unchanged).
- Linformer (k = 256, one E, F pair shared by the heads) vs ``linformer``
  ``LinformerSelfAttention`` (model width 256, its default k = 256): the same q, k, v, output
  projections and E = proj_kᵀ, F = proj_vᵀ around our per-head part.
- Nyström (256 landmarks, 6 pseudo-inverse steps) vs ``nystrom-attention`` ``NystromAttention``
  with its defaults (256 landmarks, 6 steps, the depth-wise residual convolution of the values,
  kernel 33): the same projections and the same (copied) residual convolution around our part.
  The peer scales its pseudo-inverse's first iterate by one norm over all heads, ours per head,
  so the output check runs with one head (H=1), where the two coincide.
- LSH with 1 and 2 hash rounds (bucket size 64, N/64 buckets, shared QK) vs ``reformer-pytorch``
  ``LSHAttention`` with ``attend_across_buckets=False, allow_duplicate_attention=False`` (the
  exact attention over the union of the rounds that we compute; its defaults attend across
  buckets and count duplicates, another function): the output check draws the
  peer's random rotations from a seeded generator and gives us the same rotations.
- sliding window |i − j| ≤ 256 vs ``local-attention`` ``LocalAttention(window_size=256,
  look_backward=1, look_forward=1, exact_windowsize=True)`` without rotary embeddings (its
  default window is block-aligned, up to 3 × 256 keys, not |i − j| ≤ 256), two
  ways: ``window``, :func:`attnkit.efficient.sliding_window.sliding_window_attention` (blocks
  of queries against their band of keys); ``window-block``, ``attnkit.attention`` with the
  window's block mask and automatic kernel selection, what a layer built with
  ``pattern=patterns.sliding_window(w)`` runs (the chunked kernel's block-sparse path).
- linear attention (elu + 1) vs a plain PyTorch implementation (:func:`plain_linear`).

Time: for each N, both sides in one process, paired repeats (ours then the peer, the order
alternating), after warm-up; reported as medians and the median of the per-pair ratios. On a
shared, loaded machine the absolute times drift; the paired ratio is what counts. Memory: each
(pair, side, N) cell in a fresh Python process, which imports both packages, builds both sides,
runs one warm-up step at N = 256 (one-time costs: lazy imports), then, five times, gives freed
heap memory back (``malloc_trim``), resets the peak (VmHWM) and runs a step: the median of the
step's peak resident memory above the resident memory before it. The cell's process runs with
:data:`attnkit.benchmarking.memory.LIVE_ALLOCATOR` in its environment (a fixed ``mmap``
threshold of 64 KiB, the heap trimmed at every ``free``), so freed memory is returned at once
and the peak is live memory, not what glibc keeps from earlier steps.

A peer that is not installed is skipped with a line saying so (``pip install -e .[peers]``).

    python benchmarks/bench_peers.py [--sizes 1024,4096,16384] [--pairs performer,lsh1]
        [--repeats 7] [--threads 1] [--no-memory]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit as ak
from attnkit import patterns as pt
from attnkit.benchmarking.memory import LIVE_ALLOCATOR, live_env
from attnkit.benchmarking.memory import reset_peak as _reset_peak
from attnkit.benchmarking.memory import status as _status
from attnkit.benchmarking.timing import machine, peak_rss
from attnkit.efficient import (
    LinearAttention,
    Linformer,
    LSHAttention,
    NystromAttention,
    Performer,
)
from attnkit.efficient.sliding_window import sliding_window_attention

B, H, D = 1, 4, 64
MiB = float(1 << 20)

PEERS = {
    "performer": "performer_pytorch",
    "linformer": "linformer",
    "nystrom": "nystrom_attention",
    "lsh1": "reformer_pytorch",
    "lsh2": "reformer_pytorch",
    "window": "local_attention",
    "window-block": "local_attention",
    "linear": None,
}
WINDOW = 256
LANDMARKS = 256
BUCKET = 64


def plain_linear(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Non-causal linear attention with φ = elu + 1 (Katharopoulos eq. 5) the way it is
    usually written in plain PyTorch."""
    q, k = F.elu(q) + 1, F.elu(k) + 1
    kv = torch.einsum("bhnd,bhne->bhde", k, v)
    z = 1 / torch.einsum("bhnd,bhd->bhn", q, k.sum(-2))
    return torch.einsum("bhnd,bhde,bhn->bhne", q, kv, z)


@dataclass
class Pair:
    """One mechanism against its peer at one N: zero-argument forwards and the leaves whose
    gradients a step clears."""

    ours: Callable[[], Tensor]
    peer: Callable[[], Tensor]
    leaves: list[Tensor]
    check: Callable[[], tuple[Tensor, Tensor]]  # (ours, peer) outputs under matched conventions


def _qkv(n: int, heads: int = H) -> list[Tensor]:
    return [torch.randn(B, heads, n, D, requires_grad=True) for _ in range(3)]


def _performer(n: int) -> Pair:
    import performer_pytorch.performer_pytorch as pp

    peer = pp.FastAttention(dim_heads=D)  # its default number of features
    ours = Performer(D, n_features=peer.nb_features)
    ours.omega.copy_(peer.projection_matrix)
    q, k, v = _qkv(n)

    def check():
        original = pp.softmax_kernel
        pp.softmax_kernel = lambda *a, **kw: original(*a, **{**kw, "eps": 0.0})
        try:
            with torch.no_grad():
                return ours(q, k, v).context, peer(q, k, v)
        finally:
            pp.softmax_kernel = original

    return Pair(lambda: ours(q, k, v).context, lambda: peer(q, k, v), [q, k, v], check)


class _Projected(nn.Module):
    """Our per-head part between the peer's own input and output projections."""

    def __init__(self, to_q, to_k, to_v, to_out, part, heads: int, residual=None) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = to_q, to_k, to_v, to_out
        self.part, self.heads, self.residual = part, heads, residual

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in self._qkv())
        out = self.part(q, k, v).context
        if self.residual is not None:  # the peer's depth-wise convolution of the values
            out = out + self.residual(v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

    def _qkv(self):
        if self.to_k is None:  # one fused projection to q, k, v
            w = self.to_q.weight.chunk(3, 0)
            return [lambda x, w=part: F.linear(x, w) for part in w]
        return self.to_q, self.to_k, self.to_v


def _linformer(n: int) -> Pair:
    from linformer import LinformerSelfAttention

    peer = LinformerSelfAttention(H * D, seq_len=n, heads=H)  # its default k = 256
    part = Linformer(n, peer.k)
    with torch.no_grad():
        part.e_proj.copy_(peer.proj_k.T)
        part.f_proj.copy_(peer.proj_v.T)
    lin = [copy.deepcopy(m) for m in (peer.to_q, peer.to_k, peer.to_v, peer.to_out)]
    ours = _Projected(*lin, part, H)
    x = torch.randn(B, n, H * D, requires_grad=True)

    def check():
        with torch.no_grad():
            return ours(x), peer(x)

    return Pair(lambda: ours(x), lambda: peer(x), [x, *ours.parameters(), *peer.parameters()],
                check)  # fmt: skip


def _nystrom(n: int, heads: int = H) -> Pair:
    from nystrom_attention import NystromAttention as PeerNystrom

    peer = PeerNystrom(heads * D, dim_head=D, heads=heads)  # its defaults
    if (peer.num_landmarks, peer.pinv_iterations) != (LANDMARKS, 6):
        raise RuntimeError("nystrom-attention's defaults changed; update LANDMARKS")
    part = NystromAttention(LANDMARKS, iterations=6)
    to_qkv, to_out = copy.deepcopy(peer.to_qkv), copy.deepcopy(peer.to_out)
    conv = copy.deepcopy(peer.res_conv) if peer.residual else None
    ours = _Projected(to_qkv, None, None, to_out, part, heads, conv)
    x = torch.randn(B, n, heads * D, requires_grad=True)

    def check():
        if heads != 1:  # the peer's pseudo-inverse starts from one scale over all heads
            return _nystrom(n, heads=1).check()
        with torch.no_grad():
            return ours(x), peer(x)

    return Pair(lambda: ours(x), lambda: peer(x), [x, *ours.parameters(), *peer.parameters()],
                check)  # fmt: skip


def _lsh(n: int, rounds: int) -> Pair:
    from reformer_pytorch.reformer_pytorch import LSHAttention as PeerLSH

    peer = PeerLSH(
        bucket_size=BUCKET, n_hashes=rounds, attend_across_buckets=False,
        allow_duplicate_attention=False,
    )  # fmt: skip
    buckets = n // BUCKET
    ours = LSHAttention(D, n_buckets=buckets, n_rounds=rounds, chunk_size=BUCKET).eval()
    qk, _, v = _qkv(n)

    def run_peer():
        return peer(qk.reshape(B * H, n, D), v.reshape(B * H, n, D))[0].view(B, H, n, D)

    def check():
        torch.manual_seed(1234)  # the peer draws its rotations with torch.randn
        with torch.no_grad():
            theirs = run_peer()
        torch.manual_seed(1234)
        rot = torch.randn(1, D, rounds, buckets // 2)
        ours.rotations.copy_(rot[0].permute(1, 0, 2))
        with torch.no_grad():
            return ours(qk, None, v).context, theirs

    return Pair(lambda: ours(qk, None, v).context, run_peer, [qk, v], check)


def _window(n: int, kernel: str = "banded") -> Pair:
    from local_attention import LocalAttention

    peer = LocalAttention(WINDOW, look_backward=1, look_forward=1, exact_windowsize=True)
    bm = pt.block_mask(pt.sliding_window(WINDOW), n, block_q=128, block_k=128)
    q, k, v = _qkv(n)

    def ours():
        if kernel == "block-mask":
            return ak.attention(q, k, v, block_mask=bm).context
        return sliding_window_attention(q, k, v, WINDOW)

    def check():
        with torch.no_grad():
            return ours(), peer(q, k, v)

    return Pair(ours, lambda: peer(q, k, v), [q, k, v], check)


def _linear(n: int) -> Pair:
    ours = LinearAttention("elu+1")
    q, k, v = _qkv(n)

    def check():
        with torch.no_grad():
            return ours(q, k, v).context, plain_linear(q, k, v)

    return Pair(lambda: ours(q, k, v).context, lambda: plain_linear(q, k, v), [q, k, v], check)


BUILDERS: dict[str, Callable[[int], Pair]] = {
    "performer": _performer,
    "linformer": _linformer,
    "nystrom": _nystrom,
    "lsh1": lambda n: _lsh(n, 1),
    "lsh2": lambda n: _lsh(n, 2),
    "window": _window,
    "window-block": lambda n: _window(n, "block-mask"),
    "linear": _linear,
}
LABELS = {
    "performer": "Performer vs performer-pytorch",
    "linformer": "Linformer vs linformer",
    "nystrom": "Nyström vs nystrom-attention",
    "lsh1": "LSH 1 hash vs reformer-pytorch",
    "lsh2": "LSH 2 hashes vs reformer-pytorch",
    "window": "sliding window (banded) vs local-attention",
    "window-block": "sliding window (attnkit.attention, block mask) vs local-attention",
    "linear": "linear (elu+1) vs plain PyTorch",
}


def available(name: str) -> str | None:
    """None when the peer of ``name`` imports, else why not."""
    module = PEERS[name]
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except ImportError as err:
        return f"{module} not installed ({err}); pip install -e .[peers]"
    return None


def _step(fn: Callable[[], Tensor], leaves: list[Tensor]) -> None:
    fn().sum().backward()
    for x in leaves:
        x.grad = None


def time_pair(pair: Pair, repeats: int) -> dict:
    """Paired repeats: medians of each side and of the per-pair ratio ours / peer."""
    for fn in (pair.ours, pair.peer):
        _step(fn, pair.leaves)
    ours, peer, ratios = [], [], []
    for r in range(repeats):
        t = {}
        for side in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
            fn = pair.ours if side == "ours" else pair.peer
            start = time.perf_counter()
            _step(fn, pair.leaves)
            t[side] = time.perf_counter() - start
        ours.append(t["ours"])
        peer.append(t["peer"])
        ratios.append(t["ours"] / t["peer"])
    return {
        "ours": statistics.median(ours),
        "peer": statistics.median(peer),
        "ratio": statistics.median(ratios),
    }


def difference(pair: Pair) -> tuple[float, int, int]:
    """max |ours − peer| / max |peer| under matched conventions, and how many output rows
    (of how many) differ by more than 1e-4 of that scale (LSH: a near tie between two
    buckets can round to different buckets in the two packages' projections)."""
    a, b = pair.check()
    scale = b.abs().max()
    rows = (a - b).abs().amax(-1) / scale
    return float(rows.max()), int((rows > 1e-4).sum()), rows.numel()


def _trim() -> None:
    """Give freed heap memory back to the system (glibc), so that the resident memory before a
    step counts only live memory and the step's growth above it is its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_cell(name: str, side: str, n: int, threads: int, repeats: int = 5) -> dict:
    """One (pair, side, N) cell in this process: the peak resident memory of a step above the
    resident memory just before it (freed heap memory given back first), after a warm-up step
    at N = 256 (lazy imports, one-time set-up); the median of ``repeats`` steps. The peak is
    reset before each step where Linux allows (VmHWM), else ru_maxrss (one step)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    warm = BUILDERS[name](256)
    _step(warm.ours if side == "ours" else warm.peer, warm.leaves)
    del warm
    pair = BUILDERS[name](n)
    fn = pair.ours if side == "ours" else pair.peer
    if not _reset_peak():
        _trim()
        base = peak_rss()
        _step(fn, pair.leaves)
        return {"added": peak_rss() - base, "base": base}
    added = []
    for _ in range(repeats):
        _trim()
        _reset_peak()
        base = _status("VmRSS")
        _step(fn, pair.leaves)
        added.append(_status("VmHWM") - base)
    return {"added": statistics.median(added), "base": base}


def memory(name: str, side: str, n: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--cell", json.dumps([name, side, n, threads])]
    env = live_env({**os.environ, "OMP_NUM_THREADS": str(threads)})
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1024,4096,16384")
    parser.add_argument("--pairs", default=",".join(BUILDERS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(memory_cell(*json.loads(args.cell))))
        return
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    load = os.getloadavg()
    print(f"Machine: {machine()}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"B={B}, H={H}, d={D}, float32, forward + backward; time: median of {args.repeats} "
          "paired repeats in one process; memory: fresh process per cell, "
          f"{' '.join(f'{k}={v}' for k, v in LIVE_ALLOCATOR.items())}\n")  # fmt: skip
    rows = []
    for name in args.pairs.split(","):
        why = available(name)
        if why is not None:
            print(f"skipped {LABELS[name]}: {why}")
            continue
        for n in sizes:
            torch.manual_seed(0)
            pair = BUILDERS[name](n)
            diff = difference(pair)
            print(f"{LABELS[name]}, N={n}: max rel. diff {diff[0]:.1e} ({diff[1]} of {diff[2]} "
                  "rows above 1e-4); timing", file=sys.stderr, flush=True)  # fmt: skip
            t = time_pair(pair, args.repeats)
            del pair
            mem = {}
            if not args.no_memory:
                mem = {s: memory(name, s, n, args.threads) for s in ("ours", "peer")}
            rows.append((name, n, diff, t, mem))
            print(_row(rows[-1]), file=sys.stderr, flush=True)
    print(
        "| pair | N | max rel. diff | ours ms | peer ms | time ratio | ours MiB | peer MiB "
        "| memory ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for row in rows:
        print(_row(row))
    print(f"\nload average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def _row(row) -> str:
    name, n, diff, t, mem = row
    worst, off, total = diff
    agree = f"{worst:.1e}" + (f" ({off}/{total} rows)" if off else "")
    cells = [LABELS[name], str(n), agree, f"{t['ours'] * 1e3:.1f}",
             f"{t['peer'] * 1e3:.1f}", f"{t['ratio']:.2f}"]  # fmt: skip
    if mem:
        got = [mem[s].get("added") for s in ("ours", "peer")]
        cells += [f"{g / MiB:.1f}" if g is not None else "failed" for g in got]
        ok = None not in got and got[1] > 0
        cells.append(f"{got[0] / got[1]:.2f}" if ok else "-")
    else:
        cells += ["-", "-", "-"]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
