"""Ring attention over 1, 2 and 4 processes (gloo, one thread each): time per training step
(forward + backward), peak memory per rank, and what travels against what is computed.

    python benchmarks/bench_ring.py [--quick] [--sizes 4096 8192 16384] [--procs 1 2 4]
                                    [--align softmax] [--heads 1] [--head-dim 64]

Every configuration runs in freshly spawned processes (so ``ru_maxrss`` is that configuration's
peak); the sequence is causal, laid out zig-zag (balanced). The table gives the median step
time, the speed-up over one process, the peak resident memory per rank (and its growth during
the steps, which is what the sequence costs), the bytes each rank sends per step, and the
matmul flops each rank does per step: forward 4·M·N·d per head and backward (with the score
recomputation) 10·M·N·d, halved by the causal mask, divided over the P ranks. On a machine with
fewer cores than processes the speed-up is bounded by the cores, not by the algorithm: compare
the communication volume with the compute instead (bytes per flop).
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

from attnkit.benchmarking.timing import machine


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


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
    before = _rss_kib()
    times, sent = [], []
    for _ in range(cfg["repeats"]):
        dist.barrier()
        transport.reset_traffic()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        sent.append(transport.bytes_sent())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(f"{statistics.median(times)} {peak} {peak - before} {statistics.median(sent)}")
    dist.destroy_process_group()


def run(cfg: dict, world: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, cfg, out), nprocs=world, join=True)
        rows = []
        for r in range(world):
            with open(f"{out}/rank{r}.txt") as f:
                rows.append([float(x) for x in f.read().split()])
    return {
        "seconds": max(r[0] for r in rows),  # a step ends when the slowest rank ends
        "peak_mib": max(r[1] for r in rows) / 1024,
        "growth_mib": max(r[2] for r in rows) / 1024,
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
    args = parser.parse_args()
    sizes, procs = ([512, 1024], [1, 2]) if args.quick else (args.sizes, args.procs)
    print(f"Machine: {machine()}; {os.cpu_count()} cores; 1 thread per process\n")
    print(
        f"Causal ring attention, zigzag layout, scaled_dot x {args.align}, float32, "
        f"B = 1, H = {args.heads}, d = {args.head_dim}; forward + backward per step.\n"
    )
    print(
        "| S | P | step (s) | speed-up vs P = 1 | peak RSS / rank (MiB) | growth / rank (MiB) "
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
            r = run(cfg, world)
            base = r["seconds"] if world == 1 else base
            speedup = f"{base / r['seconds']:.2f}" if base else "-"
            flops = 14 * seq * seq * args.head_dim * args.heads * 0.5 / world
            print(
                f"| {seq} | {world} | {r['seconds']:.3f} | {speedup} | {r['peak_mib']:.0f} | "
                f"{r['growth_mib']:.1f} | {r['sent_mib']:.2f} | {flops / 1e9:.2f} | "
                f"{r['sent_mib'] * 2**20 / flops:.2e} |"
            )


if __name__ == "__main__":
    main()
