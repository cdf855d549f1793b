"""Workers for tests/distributed/test_ring.py: each spawned rank runs every case of its world
size against the single-process kernels on the whole sequence and writes what failed to a file.

The whole sequence is built from one seed on every rank, so each rank can compute the
single-process reference itself and compare its own part (outputs and input gradients); the
parameters' gradients are summed over the group first.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import attnkit as ak
from attnkit import alignments as al
from attnkit import scores as sc
from attnkit.distributed import RingAttention, RingError, ring_attention, shard, transport
from attnkit.kernels import BlockMask

TOL = 1e-10
GROUP: dist.ProcessGroup | None = None  # the ring of the world size under test
B, H, D, D_V = 2, 2, 4, 3


def _init(rank: int, world: int, store: str, timeout: float = 60.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _score(name: str) -> sc.Score:
    torch.manual_seed(11)  # the same parameters on every rank and in the reference
    if name == "additive":
        return sc.Additive(D, D, 5, dtype=torch.float64)
    return sc.build(name)


def _align(name: str) -> al.Alignment:
    if name == "entmax13":
        return al.Entmax(1.3)
    return al.build(name)


def _inputs(seq: int, padded: bool):
    g = torch.Generator().manual_seed(seq * 7 + 1)
    q = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, seq, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, seq, D_V, generator=g, dtype=torch.float64)
    w = torch.randn(B, H, seq, D_V, generator=g, dtype=torch.float64)
    pad = None
    if padded:
        pad = torch.ones(B, seq, dtype=torch.bool)
        pad[0, -3:] = False  # trailing padding
        pad[1, :2] = False  # leading padding: under a causal mask rows 0 and 1 have no key
    return q, k, v, w, pad


def _reference(q, k, v, w, score, align, *, causal, pad, kernel, block_mask=None, score_mod=None):
    """Output and gradients of the single-process kernel on the whole sequence."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    seq = q.shape[-2]
    mask = None
    if causal:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    if pad is not None:
        keys = pad[:, None, None, :]
        mask = keys if mask is None else mask & keys
    for p in score.parameters():
        p.grad = None
    out = ak.attention(
        q,
        k,
        v,
        score=score,
        align=align,
        mask=mask,
        kernel=kernel,
        chunk_size=3 if kernel == "chunked" else None,
        block_mask=block_mask,
        score_mod=score_mod,
    ).context
    (out * w).sum().backward()
    params = [p.grad.clone() for p in score.parameters()]
    return out.detach(), q.grad, k.grad, v.grad, params


def _ring(q, k, v, w, score, align, *, causal, pad, layout, rank, world, **extra):
    part = {
        name: shard(x, rank, world, layout=layout).detach().clone().requires_grad_()
        for name, x in (("q", q), ("k", k), ("v", v))
    }
    pad_part = None if pad is None else shard(pad, rank, world, layout=layout, dim=-1)
    for p in score.parameters():
        p.grad = None
    out = ring_attention(
        part["q"],
        part["k"],
        part["v"],
        score=score,
        align=align,
        causal=causal,
        key_padding_mask=pad_part,
        layout=layout,
        group=GROUP,
        chunk_size=2,
        **extra,
    ).context
    (out * shard(w, rank, world, layout=layout)).sum().backward()
    params = []
    for p in score.parameters():
        g = p.grad.clone()
        dist.all_reduce(
            g, group=GROUP
        )  # each rank holds its queries' part of a parameter's gradient
        params.append(g)
    return out.detach(), part["q"].grad, part["k"].grad, part["v"].grad, params


def _compare(label, got, want, rank, world, layout, failures) -> None:
    names = ["context", "dq", "dk", "dv"]
    for name, g, ref in zip(names, got[:4], want[:4], strict=True):
        if ref is None:  # a score that ignores the keys' content: no gradient there
            if g is not None and g.abs().max().item() != 0:
                failures.append(f"{label}: {name} should be zero")
            continue
        ref_part = shard(ref, rank, world, layout=layout)
        err = (g - ref_part).abs().max().item()
        if not err <= TOL:  # also catches NaN
            failures.append(f"{label}: {name} differs by {err:.3g}")
    for i, (g, ref) in enumerate(zip(got[4], want[4], strict=True)):
        err = (g - ref).abs().max().item()
        if not err <= TOL:
            failures.append(f"{label}: parameter {i} gradient differs by {err:.3g}")


CASES = [
    # (score, align, causal, padded, layout)
    *(
        (s, a, False, False, "contiguous")
        for s in ("scaled_dot", "additive")
        for a in ("softmax", "sparsemax", "entmax15", "sigmoid")
    ),
    *(
        (s, a, True, True, "zigzag")
        for s in ("scaled_dot", "additive")
        for a in ("softmax", "sparsemax", "entmax15", "sigmoid")
    ),
    *(
        ("scaled_dot", a, True, True, "contiguous")
        for a in ("softmax", "sparsemax", "entmax15", "sigmoid")
    ),
    ("scaled_dot", "entmax13", True, False, "zigzag"),
    ("additive", "sparsemax", False, True, "zigzag"),
]


def _errors(rank: int, world: int, failures: list[str]) -> int:
    """Bad calls: every rank must raise the same ValueError, and nobody may hang."""
    checks = 0
    x = torch.randn(1, 2 * world, D, dtype=torch.float64)
    # Ranks that hold parts of different lengths.
    local = torch.randn(1, 4 if rank == 0 else 6, D, dtype=torch.float64)
    try:
        ring_attention(local, local, local, group=GROUP)
        failures.append("different lengths per rank were accepted")
    except ValueError as err:
        checks += 1
        if "different calls" not in str(err) or "rank 1" not in str(err):
            failures.append(f"unclear message for different lengths: {err}")
    # Ranks that disagree on the layout.
    try:
        ring_attention(x, x, x, group=GROUP, layout="zigzag" if rank == 0 else "contiguous")
        failures.append("different layouts per rank were accepted")
    except ValueError as err:
        checks += 1
        if "different calls" not in str(err):
            failures.append(f"unclear message for different layouts: {err}")
    # zigzag needs an even part per rank.
    odd = torch.randn(1, 3, D, dtype=torch.float64)
    try:
        ring_attention(odd, odd, odd, group=GROUP, layout="zigzag", causal=True)
        failures.append("an odd part under the zigzag layout was accepted")
    except ValueError as err:
        checks += 1
        if "even" not in str(err):
            failures.append(f"unclear message for an odd zigzag part: {err}")
    # A block mask built for a sequence that is not the group's.
    bm = BlockMask.from_mask_mod(lambda b, h, qi, ki: qi >= ki, 5, 5, block_q=2, block_k=2)
    try:
        ring_attention(x[:, :2], x[:, :2], x[:, :2], group=GROUP, block_mask=bm)
        failures.append("a block mask of the wrong size was accepted")
    except ValueError as err:
        checks += 1
        if "block_mask" not in str(err):
            failures.append(f"unclear message for a block mask of the wrong size: {err}")
    # What travels in a forward turn: the other P - 1 ranks' keys and values, once each.
    transport.reset_traffic()
    with torch.no_grad():
        ring_attention(x, x, x[..., :3], group=GROUP)
    want = (world - 1) * (x[..., :3].numel() + x.numel()) * x.element_size()
    checks += 1
    if transport.bytes_sent() != want:
        failures.append(f"a forward turn sent {transport.bytes_sent()} bytes, expected {want}")
    # The group still works after the refused calls.
    out = ring_attention(x[:, :2], x[:, :2], x[:, :2], group=GROUP).context
    checks += int(out.shape == (1, 2, D))
    return checks


def _extras(rank: int, world: int, failures: list[str]) -> int:
    """Block masks and score_mod (global positions), compared with the single-process kernel."""
    seq = 8 * world
    q, k, v, w, pad = _inputs(seq, padded=True)
    score, align = _score("scaled_dot"), _align("sparsemax")

    def sliding(b, h, qi, ki):
        return (qi - ki).abs() <= 3

    bm = BlockMask.from_mask_mod(sliding, seq, seq, block_q=2, block_k=2)

    def mod(e, b, h, qi, ki):
        return e - 0.1 * (qi - ki).abs().to(e.dtype) + 0.05 * h.to(e.dtype)

    checks = 0
    layouts = ("contiguous", "zigzag") if world == 2 else ("zigzag",)
    for layout in layouts:
        for extra in ({"block_mask": bm}, {"score_mod": mod}, {"block_mask": bm, "score_mod": mod}):
            label = f"P={world} {layout} {sorted(extra)}"
            want = _reference(
                q, k, v, w, score, align, causal=True, pad=pad, kernel="dense", **extra
            )
            got = _ring(
                q,
                k,
                v,
                w,
                score,
                align,
                causal=True,
                pad=pad,
                layout=layout,
                rank=rank,
                world=world,
                **extra,
            )
            _compare(label, got, want, rank, world, layout, failures)
            checks += 1
    checks += _multihead(rank, world, failures)
    checks += _keys_on_other_ranks(rank, world, failures)
    if world == 2:
        checks += _uneven_sweeps(rank, world, failures)
        # A position-based score (Location: one learned logit per query and key position)
        # reads global key positions.
        torch.manual_seed(5)
        location = sc.Location(D, seq, dtype=torch.float64)
        want = _reference(
            q, k, v, w, location, _align("softmax"), causal=True, pad=pad, kernel="dense"
        )
        got = _ring(
            q,
            k,
            v,
            w,
            location,
            _align("softmax"),
            causal=True,
            pad=pad,
            layout="zigzag",
            rank=rank,
            world=world,
        )
        _compare("location score", got, want, rank, world, "zigzag", failures)
        checks += 1
        # NaN in the padded keys and values reaches nothing, forward or backward.
        k_nan, v_nan = k.clone(), v.clone()
        k_nan[0, :, -1] = float("nan")
        v_nan[1, :, 0] = float("inf")
        for align_name in ("softmax", "sparsemax"):
            align = _align(align_name)
            want = _reference(
                q, k_nan, v_nan, w, score, align, causal=True, pad=pad, kernel="dense"
            )
            got = _ring(
                q,
                k_nan,
                v_nan,
                w,
                score,
                align,
                causal=True,
                pad=pad,
                layout="zigzag",
                rank=rank,
                world=world,
            )
            _compare(f"NaN padding {align_name}", got, want, rank, world, "zigzag", failures)
            checks += 1
        # float32 (to float32 rounding) and keys/values shared by the heads (B, 1, N, d).
        for align_name in ("softmax", "entmax15"):
            align = _align(align_name)
            q32, k32, v32, w32 = (x.float() for x in (q, k[:, :1], v[:, :1], w))
            want = _reference(
                q32, k32, v32, w32, score, align, causal=True, pad=pad, kernel="dense"
            )
            got = _ring(
                q32,
                k32,
                v32,
                w32,
                score,
                align,
                causal=True,
                pad=pad,
                layout="zigzag",
                rank=rank,
                world=world,
            )
            for name, g, ref in zip(("context", "dq", "dk", "dv"), got, want, strict=False):
                err = (g - shard(ref, rank, world, layout="zigzag")).abs().max().item()
                if not err <= 1e-5:
                    failures.append(f"float32 shared heads {align_name}: {name} differs by {err}")
            checks += 1
    return checks


def _multihead(rank: int, world: int, failures: list[str]) -> int:
    """MultiHeadAttention with RingAttention in its attention slot, each rank on its tokens,
    equals the layer on the whole sequence with a causal and padding mask."""
    seq, embed = 8 * world, 8
    g = torch.Generator().manual_seed(23)
    x = torch.randn(B, seq, embed, generator=g, dtype=torch.float64)
    w = torch.randn(B, seq, embed, generator=g, dtype=torch.float64)
    lengths = torch.tensor([seq - 3, seq])
    checks = 0
    for align_name in ("softmax", "entmax15"):
        ref = ak.MultiHeadAttention(embed, 2, align=align_name, dtype=torch.float64)
        part = RingAttention(align=align_name, group=GROUP, causal=True, layout="zigzag")
        mha = ak.MultiHeadAttention(embed, 2, attention=part, dtype=torch.float64)
        mha.load_state_dict(ref.state_dict())
        full = x.clone().requires_grad_()
        mask = ak.masks.from_lengths(lengths, seq) & torch.ones(seq, seq, dtype=torch.bool).tril()
        (ref(full, full, full, mask=mask).context * w).sum().backward()
        local = shard(x, rank, world, layout="zigzag").requires_grad_()
        pad = shard(ak.masks.from_lengths(lengths, seq), rank, world, layout="zigzag", dim=-1)
        out = mha(local, local, local, mask=pad).context
        (out * shard(w, rank, world, layout="zigzag")).sum().backward()
        label = f"P={world} MultiHeadAttention {align_name}"
        for name, got, want in (
            ("context", out.detach(), ref(full, full, full, mask=mask).context.detach()),
            ("d input", local.grad, full.grad),
        ):
            err = (got - shard(want, rank, world, layout="zigzag")).abs().max().item()
            if not err <= TOL:
                failures.append(f"{label}: {name} differs by {err:.3g}")
        for (name, p), (_, p_ref) in zip(
            mha.named_parameters(), ref.named_parameters(), strict=True
        ):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=GROUP)
            err = (grad - p_ref.grad).abs().max().item()
            if not err <= TOL:
                failures.append(f"{label}: gradient of {name} differs by {err:.3g}")
        checks += 1
    return checks


def _keys_on_other_ranks(rank: int, world: int, failures: list[str]) -> int:
    """RingAttention in MultiHeadAttention (not causal, contiguous) where item 0's real tokens
    all lie on rank 0: every other rank's keys are padding for it, and its queries there
    still attend rank 0's keys (the template leaves a sharded part's rows without a key here
    to the part), as the layer on the whole sequence with that key padding."""
    seq, embed = 8 * world, 8
    g = torch.Generator().manual_seed(29)
    x = torch.randn(B, seq, embed, generator=g, dtype=torch.float64)
    lengths = torch.tensor([8, seq])
    ref = ak.MultiHeadAttention(embed, 2, dtype=torch.float64)
    part = RingAttention(group=GROUP, layout="contiguous")
    mha = ak.MultiHeadAttention(embed, 2, attention=part, dtype=torch.float64)
    mha.load_state_dict(ref.state_dict())
    pad = ak.masks.from_lengths(lengths, seq)
    want = ref(x, x, x, mask=pad).context.detach()
    local = shard(x, rank, world, layout="contiguous")
    got = mha(local, local, local, mask=shard(pad, rank, world, layout="contiguous", dim=-1))
    err = (got.context.detach() - shard(want, rank, world, layout="contiguous")).abs().max()
    if not err.item() <= TOL:
        failures.append(f"P={world} keys on other ranks only: context differs by {err:.3g}")
    return 1


def _uneven_sweeps(rank: int, world: int, failures: list[str]) -> int:
    """Rows whose threshold search needs different numbers of sweeps on different ranks (peaked
    rows on rank 0, flat rows over more keys than the search's start sees on rank 1): the rank
    that is done forwards the blocks for the other, and the result is still exact."""
    seq = 160
    q, k, v, w, _ = _inputs(seq, padded=False)
    scale = torch.ones(seq, 1, dtype=q.dtype)
    scale[: seq // 2], scale[seq // 2 :] = 30.0, 0.05
    q = q * scale
    votes: list[tuple[bool, bool]] = []
    agree = transport.Ring.any

    def counted(self, flag, device):
        result = agree(self, flag, device)
        votes.append((flag, result))
        return result

    checks = 0
    transport.Ring.any = counted
    try:
        for align_name in ("sparsemax", "entmax15"):
            score, align = _score("scaled_dot"), _align(align_name)
            got = _ring(
                q,
                k,
                v,
                w,
                score,
                align,
                causal=False,
                pad=None,
                layout="contiguous",
                rank=rank,
                world=world,
            )
            want = _reference(q, k, v, w, score, align, causal=False, pad=None, kernel="dense")
            _compare(f"uneven sweeps {align_name}", got, want, rank, world, "contiguous", failures)
            checks += 1
    finally:
        transport.Ring.any = agree
    forwarded = torch.tensor([sum(1 for flag, any_ in votes if any_ and not flag)])
    dist.all_reduce(forwarded, group=GROUP)
    if forwarded.item() == 0:
        failures.append("no rank forwarded blocks for another's sweep: the case tests nothing")
    return checks


def _dies(rank: int, world: int, failures: list[str]) -> int:
    """Rank 1 stops in the middle of a ring step; rank 0 must raise a RingError."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
    if rank > 1:
        return 0
    x = torch.randn(1, 4, D, dtype=torch.float64, requires_grad=True)

    def mod(e, b, h, qi, ki):
        if rank == 1:
            os._exit(0)  # the process stops without leaving the group
        return e

    try:
        # Rank 1 has posted its first block when it stops: rank 0 may finish the forward turn,
        # but not the backward one.
        ring_attention(x, x, x, group=group, score_mod=mod).context.sum().backward()
        failures.append("rank 0 finished although rank 1 stopped")
    except RingError as err:
        if "rank 0 of" not in str(err) or "timeout" not in str(err):
            failures.append(f"unclear message when a rank stops: {err}")
        return 1
    return 0


def _plan(world: int) -> tuple[list, tuple[str, ...], bool]:
    """(cases, reference kernels, block mask / score_mod cases) of a world size: the whole grid
    on 2 ranks, the causal zigzag cases (the steps that differ with P) on 3 and 4."""
    if world == 2:
        return CASES, ("dense", "chunked"), True
    causal = [c for c in CASES if c[2] and c[4] == "zigzag"]
    if world == 3:
        return causal, ("dense",), False
    return [c for c in causal if c[0] == "scaled_dot"], ("dense",), True


def _run_world(rank: int, world: int, out_dir: str) -> None:
    failures: list[str] = []
    checks = 0
    cases, kernels, extras = _plan(world)
    try:
        seq = 8 * world
        for score_name, align_name, causal, padded, layout in cases:
            q, k, v, w, pad = _inputs(seq, padded)
            score, align = _score(score_name), _align(align_name)
            label = f"P={world} {score_name} x {align_name} causal={causal} pad={padded} {layout}"
            got = _ring(
                q,
                k,
                v,
                w,
                score,
                align,
                causal=causal,
                pad=pad,
                layout=layout,
                rank=rank,
                world=world,
            )
            for kernel in kernels:
                want = _reference(q, k, v, w, score, align, causal=causal, pad=pad, kernel=kernel)
                _compare(f"{label} vs {kernel}", got, want, rank, world, layout, failures)
            checks += 1
        if extras:
            checks += _extras(rank, world, failures)
        checks += _errors(rank, world, failures)
    except Exception:
        failures.append(traceback.format_exc())
    result = {"checks": checks, "failures": failures}
    Path(out_dir, f"world{world}_rank{rank}.json").write_text(json.dumps(result))


def run(rank: int, world: int, out_dir: str) -> None:
    """Rings of 2, 3 and ``world`` ranks (subgroups of one spawned world), then a ring of 2 in
    which rank 1 stops."""
    global GROUP
    _init(rank, world, os.path.join(out_dir, "store"))
    for size in range(2, world + 1):
        # new_group is collective over the whole world, members or not.
        GROUP = None if size == world else dist.new_group(list(range(size)))
        if rank < size:
            _run_world(rank, size, out_dir)
    GROUP = None
    failures: list[str] = []
    try:
        dies = _dies(rank, world, failures)
    except Exception:
        dies = 0
        failures.append(traceback.format_exc())
    if rank == 0:
        Path(out_dir, "dies.json").write_text(json.dumps({"dies": dies, "failures": failures}))


def run_nccl(rank: int, world: int, out_dir: str) -> None:
    """The causal zigzag cases on CUDA tensors over NCCL (one GPU per rank)."""
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{os.path.join(out_dir, 'store')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    failures: list[str] = []
    checks = 0
    device = torch.device("cuda", rank)
    try:
        for score_name, align_name, causal, padded, layout in _plan(3)[0]:
            q, k, v, w, pad = (
                None if x is None else x.to(device) for x in _inputs(8 * world, padded)
            )
            score, align = _score(score_name).to(device), _align(align_name)
            label = f"nccl P={world} {score_name} x {align_name}"
            got = _ring(
                q,
                k,
                v,
                w,
                score,
                align,
                causal=causal,
                pad=pad,
                layout=layout,
                rank=rank,
                world=world,
            )
            want = _reference(q, k, v, w, score, align, causal=causal, pad=pad, kernel="dense")
            _compare(label, got, want, rank, world, layout, failures)
            checks += 1
    except Exception:
        failures.append(traceback.format_exc())
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"checks": checks, "failures": failures})
    )
    dist.destroy_process_group()
