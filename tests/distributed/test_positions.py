"""Position schemes under context parallelism: a MultiHeadAttention layer with RoPE (plain and
dynamic-NTK scaled), ALiBi or T5 buckets, split over a ring of 2 processes (both layouts, causal
or not), equals the same layer on the whole sequence in one process (float64, 1e-10), outputs,
input gradients and parameter gradients (T5's table included); ranks whose parts differ are
refused on every rank.

The reference is the layer itself on the whole sequence with its own position slot (the
scheme's forward with offsets 0), computed on each rank; the ring twin comes from
:func:`attnkit.distributed.context_parallel`, which moves the scheme into the ring part.
"""

from __future__ import annotations

import datetime
import json
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnkit as ak
from attnkit.distributed import (
    RingAttention,
    RingPositions,
    context_parallel,
    global_positions,
    shard,
)
from attnkit.positions import ALiBi, Rotary, ScaledRotary, T5Relative
from attnkit.positions.rope_scaling import DynamicNTKScaling

WORLD = 2
TOL = 1e-10
B, S, E, H = 2, 16, 8, 2


class _LogDistance(ak.positions.PositionScheme):
    """A scheme of one's own (KERPLE's logarithmic form with r = 1): −log(1 + |i − j|) added to
    every head's scores; it declares that its bias is a function of the positions alone."""

    per_token = True
    adds_bias = True
    bias_of_positions = True

    def forward(self, q, k, *, q_offset=0, k_offset=0):
        d = ak.positions.relative_distances(q.shape[-2], k.shape[-2], q_offset, k_offset)
        return ak.positions.Positioned(q, k, -torch.log1p(d.abs().to(q.dtype)))

    def bias_at(self, e, b, h, q_idx, kv_idx):
        return e - torch.log1p((q_idx - kv_idx).abs().to(e.dtype))


class _Undeclared(_LogDistance):
    bias_of_positions = False


def _schemes():
    return {
        "own_log_distance": lambda: _LogDistance(),
        "rope": lambda: Rotary(),
        "rope_dynamic_ntk": lambda: ScaledRotary(scaling=DynamicNTKScaling(2.0, max_len=8)),
        "alibi": lambda: ALiBi(),
        "t5": lambda: T5Relative(H, num_buckets=8, max_distance=12, dtype=torch.float64),
        "t5_causal": lambda: T5Relative(
            H, num_buckets=6, max_distance=12, bidirectional=False, dtype=torch.float64
        ),
    }


def _case(name: str, layout: str, causal: bool, align: str, rank: int) -> None:
    torch.manual_seed(3)  # the same parameters and sequence on every rank
    mha = ak.MultiHeadAttention(E, H, align=align, position=_schemes()[name](), dtype=torch.float64)
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))  # T5's table away from its tiny init
    x = torch.randn(B, S, E, dtype=torch.float64)
    w = torch.randn(B, S, E, dtype=torch.float64)
    mask = torch.ones(S, S, dtype=torch.bool).tril() if causal else None
    xr = x.clone().requires_grad_()
    out = mha(xr, mask=mask).context
    (out * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in mha.named_parameters()}
    mha.zero_grad(set_to_none=True)

    twin = context_parallel(mha, layout=layout, causal=causal)
    assert isinstance(twin.attention, RingAttention) and twin.attention.position is not None
    xp = shard(x, rank, WORLD, layout=layout).requires_grad_()
    part = twin(xp).context
    (part * shard(w, rank, WORLD, layout=layout)).sum().backward()
    for p in mha.parameters():  # shared with the twin: each rank holds its part
        dist.all_reduce(p.grad)
    what = f"{name} {layout} causal={causal} {align}"
    _close(part, shard(out.detach(), rank, WORLD, layout=layout), f"{what}: output")
    _close(xp.grad, shard(xr.grad, rank, WORLD, layout=layout), f"{what}: input gradient")
    for n, p in mha.named_parameters():
        _close(p.grad, ref_grads[n], f"{what}: gradient of {n}")


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = float((a - b).abs().max())
    if not err <= TOL:
        raise AssertionError(f"{what} differs by {err:.3g}")


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    failures, checks = [], 0
    cases = [
        (name, layout, causal, align)
        for name in _schemes()
        for layout in ("contiguous", "zigzag")
        for causal in (False, True)
        for align in ("softmax", "sparsemax")
        if align == "softmax" or (layout == "zigzag" and causal)
    ]
    for case in cases:
        try:
            _case(*case, rank)
            checks += 1
        except Exception:
            failures.append(f"rank {rank}, {case}: {traceback.format_exc()}")
    try:  # a rank whose part does not match the others': every rank refuses the call
        torch.manual_seed(3)
        part = RingAttention(position=Rotary())
        x = torch.randn(1, H, 4 + 2 * rank, 4, dtype=torch.float64)
        part(x, x, x)
        failures.append(f"rank {rank}: parts of different lengths were not refused")
    except ValueError as err:
        if "given different calls" not in str(err):
            failures.append(f"rank {rank}: unexpected refusal {err}")
        checks += 1
    Path(out, f"rank{rank}.json").write_text(json.dumps({"failures": failures, "checks": checks}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("positions")
    mp.start_processes(
        _worker,
        args=(str(out / "store"), str(out)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_positions_over_a_ring_equal_the_whole_sequence(reports):
    failures = [f for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert [r["checks"] for r in reports] == [len(_schemes()) * 5 + 1] * WORLD


def test_global_positions_follow_the_layout():
    assert global_positions(0, 2, 4, "contiguous").tolist() == [0, 1, 2, 3]
    assert global_positions(1, 2, 4, "contiguous").tolist() == [4, 5, 6, 7]
    assert global_positions(0, 2, 4, "zigzag").tolist() == [0, 1, 6, 7]
    assert global_positions(1, 2, 4, "zigzag").tolist() == [2, 3, 4, 5]
    # each rank's positions are those shard gives it of 0 … S − 1
    seq = torch.arange(12).view(1, 12, 1)
    for layout in ("contiguous", "zigzag"):
        for rank in range(3):
            assert torch.equal(
                global_positions(rank, 3, 4, layout), shard(seq, rank, 3, layout=layout).flatten()
            )


def test_schemes_that_read_contents_are_refused_by_name():
    with pytest.raises(
        ValueError, match="ShawRelative cannot be split over a ring: it does not declare per_token"
    ):
        RingPositions(ak.positions.ShawRelative(4, 4))
    with pytest.raises(ValueError, match=r"_Undeclared .* does not declare bias_of_positions \("):
        RingPositions(_Undeclared())
    with pytest.raises(TypeError, match="position must be a per-head position scheme"):
        RingAttention(position=3)
    mha = ak.MultiHeadAttention(8, 2, position=ak.positions.ShawRelative(4, 4))
    with pytest.raises(ValueError, match=r"layer '': .*ShawRelative"):
        context_parallel(mha)
