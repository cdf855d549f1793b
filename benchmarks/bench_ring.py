"""Ring attention over 1, 2 and 4 processes (gloo, one thread each): time per training step
(forward + backward), peak memory per rank, and what travels against what is computed.

    python benchmarks/bench_ring.py [--quick] [--sizes 4096 8192 16384] [--procs 1 2 4]
                                    [--align softmax] [--heads 1] [--head-dim 64]

Every configuration runs in freshly spawned processes; the sequence is causal, laid out zig-zag
(balanced). The table gives the median step time, the speed-up over one process, the peak
resident memory per rank, the live memory a step adds per rank (what the sequence costs), the
bytes each rank sends per step, and the
matmul flops each rank does per step: forward 4·M·N·d per head and backward (with the score
recomputation) 10·M·N·d, halved by the causal mask, divided over the P ranks. On a machine with
fewer cores than processes the speed-up is bounded by the cores, not by the algorithm: compare
the communication volume with the compute instead (bytes per flop).

Live memory: the ranks run with :data:`attnkit.benchmarking.memory.LIVE_ALLOCATOR` in their
environment (glibc returns freed memory at once) and, before each step, the high-water mark is
reset (``/proc/self/clear_refs``); a step's live memory is its ``VmHWM`` above the ``VmRSS``
before it, the median over the steps, the largest over the ranks. Without those settings the
growth of ``ru_maxrss`` counts what glibc keeps from earlier steps (``--glibc-default`` shows it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnkit.benchmarking.memory import LIVE_ALLOCATOR, reset_peak, status
from attnkit.benchmarking.timing import machine


def _worker(rank: int, world: int, cfg: dict, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["ATTNKIT_COMPILE_TILES"] = "0"
    from attnkit.distributed import ring_attention, transport

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    seq, heads, d = cfg["seq"], cfg["heads"], cfg["head_dim"]
    local = seq // world
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, heads, local, d, generator=g).requires_grad_() for _ in range(3))

    def step() -> None:
        out = ring_attention(q, k, v, align=cfg["align"], causal=True, layout="zigzag").context
        out.sum().backward()

    step()  # warm-up
    times, sent, live = [], [], []
    for _ in range(cfg["repeats"]):
        for x in (q, k, v):
            x.grad = None
        reset_peak()
        before = status("VmRSS") or 0
        dist.barrier()
        transport.reset_traffic()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        sent.append(transport.bytes_sent())
        live.append(((status("VmHWM") or 0) - before) // 1024)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(
            f"{statistics.median(times)} {peak} {statistics.median(live)} {statistics.median(sent)}"
        )
    dist.destroy_process_group()


def run(cfg: dict, world: int, live: bool = True) -> dict:
    saved = {key: os.environ.get(key) for key in LIVE_ALLOCATOR}
    if live:  # read by glibc when each spawned rank starts
        os.environ.update(LIVE_ALLOCATOR)
    try:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(world, cfg, out), nprocs=world, join=True)
            rows = []
            for r in range(world):
                with open(f"{out}/rank{r}.txt") as f:
                    rows.append([float(x) for x in f.read().split()])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {
        "seconds": max(r[0] for r in rows),  # a step ends when the slowest rank ends
        "peak_mib": max(r[1] for r in rows) / 1024,
        "live_mib": max(r[2] for r in rows) / 1024,
        "sent_mib": max(r[3] for r in rows) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (512, 1024), 1-2 procs")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--align", default="softmax")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's allocator settings alone (the memory column then counts what it keeps)",
    )
    args = parser.parse_args()
    sizes, procs = ([512, 1024], [1, 2]) if args.quick else (args.sizes, args.procs)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"Machine: {machine()}; {os.cpu_count()} cores; 1 thread per process; load {load}")
    allocator = (
        "glibc defaults"
        if args.glibc_default
        else " ".join(f"{k}={v}" for k, v in LIVE_ALLOCATOR.items())
    )
    print(f"Allocator: {allocator}\n")
    print(
        f"Causal ring attention, zigzag layout, scaled_dot x {args.align}, float32, "
        f"B = 1, H = {args.heads}, d = {args.head_dim}; forward + backward per step.\n"
    )
    print(
        "| S | P | step (s) | speed-up vs P = 1 | peak RSS / rank (MiB) | live / rank / step (MiB) "
        "| sent / rank / step (MiB) | GFLOP / rank / step | bytes / flop |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in sizes:
        base = None
        for world in procs:
            if seq % (2 * world):
                print(f"| {seq} | {world} | (S not divisible by 2P) | | | | | | |")
                continue
            cfg = {
                "seq": seq,
                "heads": args.heads,
                "head_dim": args.head_dim,
                "align": args.align,
                "repeats": args.repeats,
            }
            print(f"... S={seq} P={world}", file=sys.stderr)
            r = run(cfg, world, live=not args.glibc_default)
            base = r["seconds"] if world == 1 else base
            speedup = f"{base / r['seconds']:.2f}" if base else "-"
            flops = 14 * seq * seq * args.head_dim * args.heads * 0.5 / world
            print(
                f"| {seq} | {world} | {r['seconds']:.3f} | {speedup} | {r['peak_mib']:.0f} | "
                f"{r['live_mib']:.1f} | {r['sent_mib']:.2f} | {flops / 1e9:.2f} | "
                f"{r['sent_mib'] * 2**20 / flops:.2e} |"
            )
    print(f"\nLoad after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
