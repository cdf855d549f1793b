"""Attention sinks over the ring: the sink softmax in streaming form equals
:class:`attnkit.modern.SinkAttention` — through the chunked kernel in one process (every key
block size) and through ring attention on rings of 2 and 4 gloo processes (one forked world of
4), causal by global positions, both layouts, with padding; outputs, input gradients and the
sink logits' gradient in float64 (1e-10).

The expectation is GPT-OSS's formula written directly: softmax over the keys and one extra
column of logit s_h whose weight is dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnkit as ak
from attnkit.distributed import StreamingSinkSoftmax, ring_attention, shard
from attnkit.modern import SinkAttention, SinkSoftmax

sys.path.insert(0, str(Path(__file__).parent))
from forked import compare, failures_of, rings, run_world

WORLD = 4
B, H, D, D_V = 2, 3, 4, 3
SINKS = torch.tensor([0.5, -1.0, 2.5], dtype=torch.float64)


def _part() -> SinkAttention:
    part = SinkAttention(H, dtype=torch.float64)
    with torch.no_grad():
        part.sinks.copy_(SINKS)
    return part


def _inputs(seq: int):
    g = torch.Generator().manual_seed(seq)
    q, k = (torch.randn(B, H, seq, D, generator=g, dtype=torch.float64) for _ in range(2))
    v, w = (torch.randn(B, H, seq, D_V, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.ones(B, seq, dtype=torch.bool)
    pad[0, -3:] = False
    pad[1, :2] = False  # rows 0 and 1 of batch 1 have no key under the causal mask
    return q, k, v, w, pad


def _with_extra_column(q, k, v, mask):
    """The formula: softmax over [e_1 … e_N, s_h], the sink column dropped; rows without a key
    0."""
    e = q @ k.mT / D**0.5
    e = e.masked_fill(~mask, float("-inf"))
    sink = SINKS[:, None, None].expand(*e.shape[:-1], 1)
    weights = torch.softmax(torch.cat([e, sink], -1), -1)[..., :-1]
    return torch.where(mask.any(-1, keepdim=True), weights @ v, torch.zeros(()))


def _masks(pad, seq):
    return pad[:, None, None, :] & torch.ones(seq, seq, dtype=torch.bool).tril()


def test_the_part_is_the_formula():
    q, k, v, _, pad = _inputs(10)
    mask = _masks(pad, 10)
    got = _part()(q, k, v, mask=mask).context
    torch.testing.assert_close(got, _with_extra_column(q, k, v, mask), rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 3, 10])
def test_the_chunked_kernel_equals_the_part(chunk_size):
    """The sink enters once per row whatever the number of key blocks: forward and gradients
    (the sink logits' too) equal the part for blocks of 1, 3 and all 10 keys."""
    q, k, v, w, pad = _inputs(10)
    mask = _masks(pad, 10)
    part = _part()
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    want = part(*inputs, mask=mask).context
    want_grads = torch.autograd.grad((want * w).sum(), [*inputs, part.sinks])
    align = StreamingSinkSoftmax.of(part.attention.align)
    got = ak.attention(
        *inputs, align=align, mask=mask, kernel="chunked", chunk_size=chunk_size
    ).context
    grads = torch.autograd.grad((got * w).sum(), [*inputs, part.sinks])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-12)
    assert align.sinks is part.sinks  # shared: the gradient reaches the part


def test_weights_sum_below_one_and_a_row_without_keys_is_zero():
    align = StreamingSinkSoftmax(torch.nn.Parameter(SINKS.clone()))
    e = torch.randn(2, H, 4, 5, dtype=torch.float64)
    mask = torch.ones(2, H, 4, 5, dtype=torch.bool)
    mask[0, :, 0] = False
    p = align(e, mask).weights
    lse = torch.logsumexp(e, -1)
    torch.testing.assert_close(p.sum(-1)[1], torch.sigmoid(lse[1] - SINKS[:, None]))
    assert bool((p[0, :, 0] == 0).all())


def test_wrong_heads_and_parts_are_refused():
    align = StreamingSinkSoftmax(torch.nn.Parameter(SINKS.clone()))
    with pytest.raises(ValueError, match=r"H = 3, got shape \(2, 2, 4, 5\)"):
        align(torch.zeros(2, 2, 4, 5))
    with pytest.raises(TypeError, match=r"must be an attnkit\.modern\.SinkSoftmax"):
        StreamingSinkSoftmax.of(ak.alignments.Softmax())
    with pytest.raises(TypeError, match=r"shape \(H,\)"):
        StreamingSinkSoftmax(torch.zeros(2, 2))
    assert isinstance(SinkSoftmax(2), ak.alignments.Alignment)


def _worker(rank: int, world: int, failures: list[str]) -> dict:
    checks: dict[str, int] = {}
    for size, group in rings(rank, world):
        done = 0
        seq = 8 * size
        q, k, v, w, pad = _inputs(seq)
        part = _part()
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        want = part(*full, mask=_masks(pad, seq)).context
        want_grads = torch.autograd.grad((want * w).sum(), [*full, part.sinks])
        align = StreamingSinkSoftmax.of(part.attention.align)
        for layout in ("contiguous", "zigzag"):
            local = [shard(x, rank, size, layout=layout).requires_grad_() for x in (q, k, v)]
            out = ring_attention(
                *local,
                align=align,
                group=group,
                causal=True,
                layout=layout,
                key_padding_mask=shard(pad, rank, size, layout=layout, dim=-1),
                chunk_size=3,
            ).context
            loss = (out * shard(w, rank, size, layout=layout)).sum()
            grads = torch.autograd.grad(loss, [*local, part.sinks])
            label = f"P={size} sinks {layout}"
            for name, g, ref in zip(
                ("context", "dq", "dk", "dv"), (out, *grads), (want, *want_grads), strict=False
            ):
                compare(
                    g.detach(), shard(ref, rank, size, layout=layout), f"{label} {name}", failures
                )
            d_sinks = grads[3].clone()
            torch.distributed.all_reduce(d_sinks, group=group)
            compare(d_sinks, want_grads[3], f"{label} d sinks", failures)
            done += 1
        checks[str(size)] = done
    return checks


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("sinks"))


@pytest.mark.parametrize("size", [2, 4])
def test_sinks_over_a_ring_equal_one_process(size, reports):
    assert not failures_of(reports), failures_of(reports)
    assert [r["checks"][str(size)] for r in reports[:size]] == [2] * size
