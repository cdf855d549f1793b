"""Attention over (query, key block) pairs tiled by key block, forward and the hand-written
backward, against dense float64 attention over the union of each query's pairs (autograd)."""

from __future__ import annotations

import pytest
import torch

from attnkit.sparse_trainable._pairs import tile_backward, tile_forward, tiles

D = torch.float64


def _problem(seed, count=2, q=5, n=11, d=3, dv=2, block=3, slots=3):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // block)
    qs = torch.randn(count * q, d, generator=g, dtype=D)
    k = torch.randn(count * n, d, generator=g, dtype=D)
    v = torch.randn(count * n, dv, generator=g, dtype=D)
    # a query's pairs name distinct blocks
    pick = torch.rand(count, q, blocks, generator=g).argsort(-1)[..., :slots]
    keep = torch.rand(count, q, slots, generator=g) < 0.8
    keep[0, 1] = False  # a query without a pair
    lo = torch.randint(-2, n // 2, (q,), generator=g)
    hi = lo + torch.randint(0, n, (q,), generator=g)
    rows = torch.rand(count, q, n, generator=g) < 0.8
    return qs, k, v, pick, keep, lo, hi, rows, blocks


def _dense_allowed(pick, keep, lo, hi, rows, n, block, with_rows):
    """(count·Q, N) the keys each query reads: its pairs' blocks within [lo, hi] (and rows)."""
    count, q, slots = pick.shape
    allowed = torch.zeros(count, q, n, dtype=torch.bool)
    for c in range(count):
        for m in range(q):
            for s in range(slots):
                if keep[c, m, s]:
                    for j in range(pick[c, m, s] * block, (pick[c, m, s] + 1) * block):
                        if j < n and lo[m] <= j <= hi[m] and (not with_rows or rows[c, m, j]):
                            allowed[c, m, j] = True
    return allowed.view(count * q, n)


@pytest.mark.parametrize("size", [1, 2, 8])
@pytest.mark.parametrize("with_rows", [False, True])
def test_tiles_match_dense_attention_over_the_pairs(size, with_rows):
    count, q, n, block = 2, 5, 11, 3
    qs, k, v, pick, keep, lo, hi, rows, blocks = _problem(size, count, q, n, block=block)
    hi = hi.clamp_max(n - 1)
    item = torch.arange(count)[:, None, None].expand_as(pick)
    row = item * q + torch.arange(q)[:, None]
    sel = keep.reshape(-1)
    t = tiles(
        item.reshape(-1)[sel], pick.reshape(-1)[sel], row.reshape(-1)[sel],
        lo[:, None].expand_as(pick).reshape(-1)[sel], hi[:, None].expand_as(pick).reshape(-1)[sel],
        items=count, blocks=blocks, block_size=block, empty=count * q, size=size,
    )  # fmt: skip

    def lookup(query, pos):
        return rows.reshape(-1)[query.clamp_max(count * q - 1)[..., None] * n + pos[:, None, :]]

    look = lookup if with_rows else None
    qf = torch.cat([qs, qs.new_zeros(1, 3)])
    out, lse = tile_forward(qf, k, v, t, n=n, block_size=block, scale=0.7, rows=look)

    allowed = _dense_allowed(pick, keep, lo, hi, rows, n, block, with_rows)
    qd, kd, vd = (x.clone().requires_grad_() for x in (qs, k, v))
    gate = torch.rand(count * q, dtype=D, generator=torch.Generator().manual_seed(9))
    gate = gate.requires_grad_()
    e = (qd.view(count, q, -1) @ kd.view(count, n, -1).transpose(1, 2)).reshape(-1, n) * 0.7
    e = e.masked_fill(~allowed, float("-inf"))
    has = allowed.any(-1, keepdim=True)
    p = torch.softmax(e.masked_fill(~has, 0.0), -1) * has
    ref = (p.view(count, q, n) @ vd.view(count, n, -1)).reshape(-1, vd.shape[-1])
    ref_lse = torch.logsumexp(e.masked_fill(~has, 0.0), -1).where(has[:, 0], 0.0)
    torch.testing.assert_close(out, ref.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-12, rtol=1e-10)
    assert not out[1].any()  # query 1 of item 0 has no pair

    r_out = torch.randn(ref.shape, dtype=D, generator=torch.Generator().manual_seed(3))
    loss = (gate[:, None] * ref * r_out).sum()
    want = torch.autograd.grad(loss, (qd, kd, vd, gate))
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(k), torch.zeros_like(v)
    r = tile_backward(
        qf, k, v, torch.cat([r_out, r_out.new_zeros(1, 2)]), torch.cat([lse, lse.new_zeros(1)]),
        torch.cat([gate.detach(), gate.new_zeros(1)]), t, dq, dk, dv,
        n=n, block_size=block, scale=0.7, rows=look,
    )  # fmt: skip
    for got, ref_grad in zip((dq[:-1], dk, dv, r[:-1]), want, strict=True):
        torch.testing.assert_close(got, ref_grad, atol=1e-12, rtol=1e-10)


def test_tiles_group_pairs_by_block_and_put_partial_blocks_first():
    """Every tile reads one (item, block); pairs reading part of their block sit in the first
    ``edges`` tiles, pairs reading it whole in the others; every pair is in exactly one slot."""
    item = torch.tensor([0, 0, 1, 0, 1, 0])
    block = torch.tensor([2, 0, 2, 2, 2, 1])
    query = torch.tensor([0, 1, 2, 3, 4, 5])
    lo = torch.tensor([0, 1, 0, 0, 0, 0])  # query 1 starts inside block 0
    hi = torch.tensor([9, 9, 9, 7, 9, 9])  # query 3 ends inside block 2 (keys 6-8)
    t = tiles(item, block, query, lo, hi, items=2, blocks=4, block_size=3, empty=6, size=2)
    assert t.edges == 2
    edge_queries = set(t.query[: t.edges].flatten().tolist()) - {6}
    assert edge_queries == {1, 3}
    placed = sorted(x for x in t.query.flatten().tolist() if x != 6)
    assert placed == [0, 1, 2, 3, 4, 5]
    for tile in range(len(t.item)):
        for slot in t.query[tile].tolist():
            if slot != 6:
                assert (int(item[slot]), int(block[slot]) * 3) == (
                    int(t.item[tile]),
                    int(t.start[tile]),
                )
